"""Live acceptance: real greedy speculative decoding with the transformers target
(speculative.py) on held-out prompts, checked token for token against plain greedy decoding,
with the wall-clock speed-up and the drafter's own time per round; the run's drafter (its
family's proposer: EAGLE-3, P-EAGLE or DFlash) and prompt lookup, and the drafter from each
depth cut."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from eaglenest.formats.metrics import LiveFigures, emitted_per_round
from eaglenest.settings.evaluate import EvaluateSettings
from eaglenest.stages.evaluate.depths import DepthCut
from eaglenest.stages.evaluate.speculative import (
    Generation,
    Prefill,
    PromptLookupProposer,
    Proposer,
    greedy_generate,
    speculative_generate,
)
from eaglenest.target_model.files import resolve_target_dir

log = logging.getLogger(__name__)


def heldout_prompts(tokens_paths: list[str | Path], n: int) -> list[list[int]]:
    """The first n held-out prompts as token ids (rendered prompt, generation prompt included)."""
    prompts: list[list[int]] = []
    for path in tokens_paths:
        frame = pl.read_parquet(path, columns=["input_ids", "prompt_len"])
        for ids, prompt_len in frame.iter_rows():
            prompts.append(list(ids[:prompt_len]))
            if len(prompts) == n:
                return prompts
    return prompts


def live(
    target,
    proposers: dict[str, Proposer],
    prompts: list[list[int]],
    ks: tuple[int, ...],
    max_new_tokens: int,
    eos_ids: set[int],
    layer_ids: list[int],
) -> dict[str, dict[str, Any]]:
    # Prompt by prompt, plain greedy then every proposer and K: each speed-up compares runs made
    # under the same load of the machine.
    greedy_wall = 0.0
    runs: dict[tuple[str, int], list] = {(name, k): [] for name in proposers for k in ks}
    identical = dict.fromkeys(runs, True)
    # The target's own time: its plain greedy steps after the prefill, and each run's rounds
    # less the drafter's share (the verification forwards and their bookkeeping). Prefills, the
    # target's and the drafter's over the prompt, are left out of both: decoding only.
    greedy_step_s, greedy_steps = 0.0, 0
    verify_s = dict.fromkeys(runs, 0.0)
    greedy_tokens = 0
    hidden_layers = layer_ids if any(p.needs_hidden for p in proposers.values()) else None
    for prompt in prompts:
        prefill = Prefill.of(target, prompt, hidden_layers)  # every run of this prompt starts here
        reference = greedy_generate(target, prompt, max_new_tokens, eos_ids, prefill)
        greedy_wall += reference.wall_s
        greedy_tokens += len(reference.tokens)
        greedy_step_s += reference.wall_s - prefill.wall_s
        greedy_steps += reference.target_forwards - 1
        for name, proposer in proposers.items():
            for k in ks:
                run = speculative_generate(
                    target, proposer, prompt, k, max_new_tokens, eos_ids, layer_ids, prefill
                )
                runs[name, k].append(run)
                verify_s[name, k] += run.wall_s - prefill.wall_s - run.draft_s - run.draft_start_s
                identical[name, k] &= run.tokens == reference.tokens
    results: dict[str, dict[str, Any]] = {name: {} for name in proposers}
    for (name, k), done in runs.items():
        rounds = [a for r in done for a in r.accept_lengths]
        tokens = sum(len(r.tokens) for r in done)
        wall = sum(r.wall_s for r in done)
        figures = LiveFigures(
            acceptance_length=float(np.mean(rounds)) if rounds else 1.0,
            emitted_per_round=emitted_per_round(tokens, len(prompts), len(rounds)),
            rounds=len(rounds),
            # Per prompt, to compare with the engine's per request (vllm_evaluate.py).
            rounds_per_prompt=[len(r.accept_lengths) for r in done],
            # Each prompt's acceptance length: the report's interval over prompts by depth.
            per_prompt=[prompt_acceptance(r) for r in done],
            drafter_s_per_round=sum(r.draft_s for r in done) / max(len(rounds), 1),
            target_s_per_round=verify_s[name, k] / max(len(rounds), 1),
            # The unit of target time the report's choice counts in (docs/report.md).
            greedy_s_per_token=greedy_step_s / greedy_steps if greedy_steps else None,
            **per_position_acceptance(done, k),
            target_forwards_per_token=sum(r.target_forwards for r in done) / max(tokens, 1),
            speedup=greedy_wall / max(wall, 1e-9),
            tokens=tokens,
            prompts=len(prompts),
            identical_to_greedy=identical[name, k],
            spec_wall_s=wall,
            greedy_wall_s=greedy_wall,
            greedy_tokens=greedy_tokens,
        )
        results[name][str(k)] = figures.to_json()
        log.info("live %s K=%d: %s", name, k, results[name][str(k)])
    return results


def prompt_acceptance(run: Generation) -> float | None:
    """One prompt's acceptance length: its rounds' mean (None: no round, nothing drafted)."""
    return float(np.mean(run.accept_lengths)) if run.accept_lengths else None


def per_position_acceptance(runs: list[Generation], k: int) -> dict[str, list]:
    """For draft position i of K: accepted at i / drafted at i over all rounds, the live
    counterpart of vLLM's spec_decode_num_accepted_tokens_per_pos / num_drafts."""
    accepted = np.zeros(k, dtype=np.int64)
    drafted = np.zeros(k, dtype=np.int64)
    for run in runs:
        accepted += run.accepted_per_position(k)
        drafted += run.drafted_per_position(k)
    return {
        "per_position_acceptance": [
            float(a / d) if d else 0.0 for a, d in zip(accepted, drafted, strict=True)
        ],
        "accepted_per_position": accepted.tolist(),
        "drafted_per_position": drafted.tolist(),
    }


def live_metrics(
    proposer_of: Callable[[], Proposer],
    prompts,
    settings: EvaluateSettings,
    target_path,
    device: str,
    model_dtype: str,
    trust_remote_code: bool,
    layer_ids: list[int],
    cuts: list[DepthCut] = (),
    family: str = "eagle3",
    groups: dict[str, list[list[int]]] | None = None,
) -> dict[str, Any]:
    """Greedy and speculative decoding with the transformers target, the drafter (a fresh
    proposer of its family from `proposer_of`, under the family's name) and prompt lookup; the
    drafter also from each depth cut (`live_by_depth`: depth -> K -> figures) and each further
    prompt group (`live_groups`: name -> K -> figures; the other thinking mode's)."""
    from eaglenest.target_model.loading import load_target

    target = load_target(target_path, device, model_dtype, trust_remote_code)
    proposers = {
        family: proposer_of(),
        "prompt_lookup": PromptLookupProposer(settings.prompt_lookup_ngram),
    }
    eos_ids = eos_token_ids(target_path, target)
    decoding = (settings.ks, settings.live_max_new_tokens)
    results = live(
        target, proposers, prompts, settings.ks, settings.live_max_new_tokens, eos_ids, layer_ids
    )
    by_depth = {}
    for cut in cuts:
        # Depth 0 is the held-out prompts themselves, decoded above.
        if cut.prompts and cut.prompts == prompts:
            by_depth[str(cut.depth)] = results[family]
        elif cut.prompts:
            log.info("live at depth %d: %d prompts", cut.depth, len(cut.prompts))
            by_depth[str(cut.depth)] = live(
                target,
                {family: proposer_of()},
                cut.prompts,
                settings.ks,
                settings.live_max_new_tokens,
                eos_ids,
                layer_ids,
            )[family]
    live_groups = {}
    for name, group in (groups or {}).items():
        log.info("live %s: %d prompts", name, len(group))
        live_groups[name] = live(
            target, {family: proposer_of()}, group, *decoding, eos_ids, layer_ids
        )[family]
    return {
        "live": results[family],
        "live_baselines": {"prompt_lookup": results["prompt_lookup"]},
        "live_by_depth": by_depth,
        **({"live_groups": live_groups} if groups else {}),
    }


def eos_token_ids(target_path: str | Path, target) -> set[int]:
    """End-of-generation ids: generation_config's eos (one or several), else the config's."""
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = target.config.eos_token_id
    if eos is None:
        config = json.loads((resolve_target_dir(target_path) / "config.json").read_text())
        eos = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
