"""Acceptance of the drafter on held-out shards (the `evaluate` stage → eval/metrics.json).

Acceptance length = 1 + accepted draft tokens per verification round: the definition vLLM and
SGLang report (the target's own "bonus" token counts as the 1).

Simulated, from stored features: at every position t whose next token x[t+1] is a completion
token, the drafter runs its chain of K steps (the training-time-test forward with K steps) and
step i is compared with the target's greedy token at position t+1+i. Feeding the data token
x[t+1+i] to step i equals feeding the drafter's own prediction as long as the chain has matched
so far, except where the stored (sampled) token differs from the greedy one: there the real
chain would continue on a sequence we have no features for, so it is counted up to that token
and cut (reported as `cut_by_sampling`). Only positions with room for K steps count.

Live: real greedy speculative decoding with the transformers target (speculative.py) on held-out
prompts, checked token for token against plain greedy decoding, with the wall-clock speed-up.

Baselines on the same data: an untrained drafter (same architecture and initialisation seed) and
prompt lookup (n-gram drafting from the context).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from eaglenest.client.capture_states import PooledStates, ask_ahead, open_pooled_shards
from eaglenest.common.devices import resolve_device
from eaglenest.common.io import write_json
from eaglenest.drafter.batches import BatchPlan, TargetSignal, build_batch, open_shards
from eaglenest.drafter.export import load_drafter
from eaglenest.drafter.model import Eagle3Drafter
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.formats.target_head import TargetHead
from eaglenest.settings.evaluate import EvaluateSettings
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.evaluate.depths import DepthCut, cut_at_depths, depth_table
from eaglenest.stages.evaluate.speculative import (
    EagleProposer,
    Generation,
    Prefill,
    PromptLookupProposer,
    greedy_generate,
    speculative_generate,
)
from eaglenest.target_model.files import resolve_target_dir

log = logging.getLogger(__name__)


# --- the counting, shared by every proposer ---------------------------------------------------


@dataclass
class AcceptanceCounts:
    k: int
    positions: int = 0
    accepted: int = 0
    reached: np.ndarray | None = None  # chains that got to step i
    hits: np.ndarray | None = None  # of those, step i matched
    cut_by_sampling: int = 0

    def __post_init__(self):
        self.reached = np.zeros(self.k, dtype=np.int64)
        self.hits = np.zeros(self.k, dtype=np.int64)

    def add(self, predicted: torch.Tensor, greedy: torch.Tensor, data_next: torch.Tensor) -> None:
        """Chains [N, K]: draft i, the target's greedy token there, and the stored token after
        the draft's position (the input of step i+1)."""
        match = predicted == greedy
        goes_on = match & (data_next == greedy)
        reached = torch.ones_like(match)
        reached[:, 1:] = goes_on[:, :-1].cumprod(dim=1).bool()
        accepted = reached & match
        self.positions += int(predicted.shape[0])
        self.accepted += int(accepted.sum())
        self.reached += reached.sum(0).cpu().numpy()
        self.hits += accepted.sum(0).cpu().numpy()
        self.cut_by_sampling += int((accepted & ~goes_on).sum())

    def result(self) -> dict[str, Any]:
        return {
            "acceptance_length": 1 + self.accepted / max(self.positions, 1),
            "conditional_acceptance": [
                float(h / r) if r else 0.0 for h, r in zip(self.hits, self.reached, strict=True)
            ],
            "positions": self.positions,
            "cut_by_sampling": self.cut_by_sampling,
        }


def chain_positions(loss_mask: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] bool: t where x[t+1] is a completion token and steps up to t+1+k stay inside."""
    b, t = loss_mask.shape
    index = torch.arange(t)[None].expand(b, t)
    next_is_completion = torch.zeros_like(loss_mask)
    next_is_completion[:, :-1] = loss_mask[:, 1:]
    return next_is_completion & (index + 1 + k <= lengths[:, None] - 1)


def shifted_stack(x: torch.Tensor, first: int, k: int, fill: int = -1) -> torch.Tensor:
    """[B, T, K]: out[:, t, i] = x[:, t + first + i]."""
    b, t = x.shape
    padded = torch.cat([x, torch.full((b, first + k), fill, dtype=x.dtype)], dim=1)
    return torch.stack([padded[:, first + i : first + i + t] for i in range(k)], dim=-1)


@torch.no_grad()
def simulate(
    proposers: dict[str, Eagle3Drafter | int],
    plan: BatchPlan,
    signal: TargetSignal,
    ks: tuple[int, ...],
    device: str = "cpu",
    depths: tuple[int, ...] = (),
) -> dict[str, dict[str, Any]]:
    """Simulated acceptance for each proposer (a drafter, or an int = prompt-lookup n-gram).
    With `depths`, also the first proposer's at the positions at or past each depth, under
    "by_depth": depth (str) -> K (str) -> figures."""
    counts = {name: {k: AcceptanceCounts(k) for k in ks} for name in proposers}
    first = next(iter(proposers))
    by_depth = {d: {k: AcceptanceCounts(k) for k in ks} for d in depths}
    kmax = max(ks)
    order = plan.epoch_order(0)
    ask_ahead(plan.shards, order)  # states from the capture servers (hidden.store none/budget)
    for refs in order:
        on_device = signal.fill(build_batch(refs, plan.shards).to(device))
        batch = on_device.to("cpu")
        lengths = torch.tensor([r.length for r in refs])
        # The target's greedy token at each position, as a target id (-1: outside the draft vocab).
        greedy_draft = batch.target_logits.argmax(-1)
        greedy = torch.where(batch.in_draft_vocab, signal.draft_ids.cpu()[greedy_draft], -1)
        greedy_next = shifted_stack(greedy, 1, kmax)  # what step i must match
        data_next = shifted_stack(batch.input_ids, 2, kmax)  # the input of step i + 1
        for name, proposer in proposers.items():
            if isinstance(proposer, int):
                predicted = lookup_predictions(
                    batch.input_ids, lengths, batch.loss_mask, kmax, proposer
                )
            else:
                start = chain_positions(batch.loss_mask, lengths, min(ks))
                predicted = chain_predictions(
                    proposer, on_device, start, greedy_next, data_next, kmax
                )
            for k in ks:
                where = chain_positions(batch.loss_mask, lengths, k)
                chains = (predicted[..., :k], greedy_next[..., :k])
                counts[name][k].add(chains[0][where], chains[1][where], data_next[where, :k])
                for depth in depths if name == first else ():
                    deep = where & (torch.arange(where.shape[1])[None] >= depth)
                    by_depth[depth][k].add(chains[0][deep], chains[1][deep], data_next[deep, :k])
    results = {
        name: {str(k): c.result() for k, c in per_k.items()} for name, per_k in counts.items()
    }
    if depths:
        results["by_depth"] = {
            str(d): {str(k): c.result() for k, c in per_k.items()} for d, per_k in by_depth.items()
        }
    return results


def chain_predictions(
    drafter: Eagle3Drafter,
    batch,
    start: torch.Tensor,
    greedy_next: torch.Tensor,
    data_next: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """[B, T, K] the drafter's step-i draft (a target id) at each position whose chain reaches
    step i: from the positions in `start`, on while each step matches the target's greedy token
    and the data goes on with it (AcceptanceCounts' `reached`); -3 (no token) elsewhere. The
    LM head runs only there: the counts are those of every position's whole chain, for a
    fraction of the head's cost (a chain mostly ends at its first or second step)."""
    b, t = start.shape
    predicted = torch.full((b, t, k), -3, dtype=torch.long)
    alive = start.clone()
    steps = drafter.teacher_forced_states(batch.aux, batch.input_ids, k)
    for i, normed in enumerate(steps):
        rows = alive.to(normed.device)
        draft = drafter.lm_head(normed[rows]).argmax(-1)
        predicted[..., i][alive] = drafter.draft_to_target(draft).cpu()
        goes_on = data_next[..., i] == greedy_next[..., i]
        alive &= (predicted[..., i] == greedy_next[..., i]) & goes_on
        if not alive.any():
            break
    return predicted


def lookup_predictions(
    input_ids: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor, k: int, ngram: int
) -> torch.Tensor:
    """[B, T, K] prompt-lookup drafts at every drafting position (-2 where it proposes nothing):
    at each position, `prompt_lookup` of the context so far, from an index of each n-gram's
    latest start that grows with the context (linear in a sample's length; searching the
    context at each position was quadratic: minutes for the long demo's 9,000-token samples)."""
    b, t = input_ids.shape
    out = torch.full((b, t, k), -2, dtype=torch.long)
    for row in range(b):
        ids = input_ids[row, : int(lengths[row])].tolist()
        latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram + 1)]
        for pos in range(len(ids) - 1):
            size = pos + 2  # the context is ids[:size]
            # The n-grams that now start early enough to have a token after them in the context.
            for n in range(1, ngram + 1):
                start = size - n - 1
                if start >= 0:
                    latest[n][tuple(ids[start : start + n])] = start
            if not loss_mask[row, pos + 1]:
                continue
            for n in range(min(ngram, size - 1), 0, -1):
                start = latest[n].get(tuple(ids[size - n : size]))
                if start is not None:
                    drafts = ids[start + n : min(start + n + k, size)]
                    out[row, pos, : len(drafts)] = torch.tensor(drafts, dtype=torch.long)
                    break
    return out


# --- live -------------------------------------------------------------------------------------


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
    proposers: dict[str, EagleProposer | PromptLookupProposer],
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
    greedy_tokens = 0
    hidden_layers = layer_ids if any(p.needs_hidden for p in proposers.values()) else None
    for prompt in prompts:
        prefill = Prefill.of(target, prompt, hidden_layers)  # every run of this prompt starts here
        reference = greedy_generate(target, prompt, max_new_tokens, eos_ids, prefill)
        greedy_wall += reference.wall_s
        greedy_tokens += len(reference.tokens)
        for name, proposer in proposers.items():
            for k in ks:
                run = speculative_generate(
                    target, proposer, prompt, k, max_new_tokens, eos_ids, layer_ids, prefill
                )
                runs[name, k].append(run)
                identical[name, k] &= run.tokens == reference.tokens
    results: dict[str, dict[str, Any]] = {name: {} for name in proposers}
    for (name, k), done in runs.items():
        rounds = [a for r in done for a in r.accept_lengths]
        tokens = sum(len(r.tokens) for r in done)
        wall = sum(r.wall_s for r in done)
        results[name][str(k)] = {
            "acceptance_length": float(np.mean(rounds)) if rounds else 1.0,
            "emitted_per_round": emitted_per_round(tokens, len(prompts), len(rounds)),
            "rounds": len(rounds),
            **per_position_acceptance(done, k),
            "target_forwards_per_token": sum(r.target_forwards for r in done) / max(tokens, 1),
            "speedup": greedy_wall / max(wall, 1e-9),
            "tokens": tokens,
            "prompts": len(prompts),
            "identical_to_greedy": identical[name, k],
            "spec_wall_s": wall,
            "greedy_wall_s": greedy_wall,
            "greedy_tokens": greedy_tokens,
        }
        log.info("live %s K=%d: %s", name, k, results[name][str(k)])
    return results


def emitted_per_round(tokens: int, prompts: int, rounds: int) -> float | None:
    """Tokens kept per verification round: all tokens less the one per prompt the prefill emits,
    over the rounds. Measured the same way for vLLM and for us (vLLM's counters, 1 + accepted /
    drafts, also count drafts accepted past the end of an answer)."""
    return (tokens - prompts) / rounds if rounds else None


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


# --- the stage --------------------------------------------------------------------------------


def untrained_like(model: Eagle3Drafter, seed: int) -> Eagle3Drafter:
    torch.manual_seed(seed)
    fresh = Eagle3Drafter(model.config)
    fresh.embed_tokens.weight.data.copy_(model.embed_tokens.weight.data)
    fresh.set_vocab(model.d2t, model.t2d)
    return fresh.to(model.fc.weight.device).eval()


def live_metrics(
    drafter, prompts, settings: EvaluateSettings, target_path, device: str, model_dtype: str,
    trust_remote_code: bool, layer_ids: list[int], cuts: list[DepthCut] = (),
) -> dict[str, Any]:  # fmt: skip
    """Greedy and speculative decoding with the transformers target, EAGLE-3 and prompt lookup;
    EAGLE-3 also from each depth cut (`live_by_depth`: depth -> K -> figures)."""
    from eaglenest.target_model.loading import load_target

    target = load_target(target_path, device, model_dtype, trust_remote_code)
    proposers = {
        "eagle3": EagleProposer(drafter),
        "prompt_lookup": PromptLookupProposer(settings.prompt_lookup_ngram),
    }
    eos_ids = eos_token_ids(target_path, target)
    results = live(
        target, proposers, prompts, settings.ks, settings.live_max_new_tokens, eos_ids, layer_ids
    )
    by_depth = {}
    for cut in cuts:
        # Depth 0 is the held-out prompts themselves, decoded above.
        if cut.prompts and cut.prompts == prompts:
            by_depth[str(cut.depth)] = results["eagle3"]
        elif cut.prompts:
            log.info("live at depth %d: %d prompts", cut.depth, len(cut.prompts))
            by_depth[str(cut.depth)] = live(
                target, {"eagle3": EagleProposer(drafter)}, cut.prompts, settings.ks,
                settings.live_max_new_tokens, eos_ids, layer_ids,
            )["eagle3"]  # fmt: skip
    return {
        "live": results["eagle3"],
        "live_baselines": {"prompt_lookup": results["prompt_lookup"]},
        "live_by_depth": by_depth,
    }


def evaluate_drafter(
    *,
    drafter_dir: str | Path,
    heldout_hidden: list[str | Path],
    heldout_tokens: list[str | Path],
    target_head: str | Path,
    draft_vocab: str | Path,
    out: str | Path,
    settings: EvaluateSettings,
    runtime: VllmRuntime | None = None,
    hidden: HiddenSettings | None = None,
) -> dict[str, Any]:
    """The evaluate stage: simulated, live (evaluate.live) and vLLM (evaluate.engine) figures.
    With `hidden` (hidden.store none/budget) and no `heldout_hidden`, the held-out states come
    from the capture servers (`runtime`), for the simulated figures, as training reads them."""
    target_path, trust_remote_code = settings.target.path, settings.target.trust_remote_code
    device = resolve_device(settings.device)
    started = time.perf_counter()
    head = TargetHead.load(target_head)
    vocab = DraftVocab.load(draft_vocab)
    # Each hidden shard's tokens shard is the same shard's: a stale pairing is refused.
    paired = heldout_tokens if len(heldout_tokens) == len(heldout_hidden) else None
    shards = open_shards(heldout_hidden, head, vocab, tokens=paired)
    pooled = heldout_tokens if hidden is not None and not heldout_hidden else []
    drafter = load_drafter(drafter_dir, head.embed, expect_layer_ids=head.aux_layer_ids)
    drafter = drafter.to(device).eval()
    states = PooledStates.of_job(hidden, runtime, out, pooled, settings.max_batch_tokens)
    try:
        shards += open_pooled_shards(states, pooled, head, vocab)
        simulated = simulate_all(
            drafter, shards, TargetSignal(head, vocab, device), settings, device
        )
    finally:
        if states is not None:
            states.close()
    simulated_by_depth = simulated.pop("by_depth", {})
    continuation = settings.live_max_new_tokens
    cuts = cut_at_depths(heldout_tokens, settings.depths, settings.live_prompts, continuation)
    for cut in cuts:
        log.info("depth %d: %s", cut.depth, cut.counts())
    for name, per_k in simulated.items():
        log.info(
            "simulated %s: %s",
            name,
            {k: round(v["acceptance_length"], 3) for k, v in per_k.items()},
        )
    metrics = simulated_metrics(settings, heldout_hidden or heldout_tokens, simulated)
    # vLLM and transformers in float32 on a CPU, as the capture and the demo run there.
    model_dtype = "float32" if device == "cpu" else "auto"
    prompts = heldout_prompts(heldout_tokens, settings.live_prompts)
    if settings.live:
        live_args = (settings, target_path, device, model_dtype, trust_remote_code)
        metrics.update(live_metrics(drafter, prompts, *live_args, head.aux_layer_ids, cuts))
        metrics["live_vs_simulated"] = {
            k: metrics["live"][k]["acceptance_length"] / simulated["eagle3"][k]["acceptance_length"]
            for k in metrics["live"]
        }
    else:
        metrics["live_skipped_reason"] = "evaluate.live is false"
    if settings.engine == "vllm":
        metrics["engine"] = engine_metrics(
            drafter_dir, prompts, cuts, settings, runtime, model_dtype
        )
        if metrics["live"]:
            metrics["live_vs_engine"] = live_vs_engine(metrics["live"], metrics["engine"]["per_k"])
    live_by_depth = metrics.pop("live_by_depth", None)
    engine_by_depth = (metrics.get("engine") or {}).pop("by_depth", None)
    if settings.depths:
        metrics["by_depth"] = depth_table(
            cuts, settings.ks, continuation, simulated_by_depth, live_by_depth, engine_by_depth
        )
    metrics["wall_s"] = time.perf_counter() - started
    write_json(out, metrics)
    return metrics


def simulate_all(
    drafter: Eagle3Drafter, shards: list, signal: TargetSignal, settings: EvaluateSettings, device
) -> dict[str, dict[str, Any]]:
    """`simulate` of the drafter, its untrained twin and prompt lookup on the held-out shards."""
    untrained = untrained_like(drafter, settings.seed)
    plan = BatchPlan(shards, settings.max_batch_tokens, settings.seed)
    proposers = {"eagle3": drafter, "untrained": untrained}
    proposers["prompt_lookup"] = settings.prompt_lookup_ngram
    return simulate(proposers, plan, signal, settings.ks, device, settings.depths)


def simulated_metrics(
    settings: EvaluateSettings, heldout_hidden: list[str | Path], simulated: dict[str, Any]
) -> dict[str, Any]:
    """metrics.json's frame: the simulated figures, the live and engine ones still to come."""
    return {
        "ks": list(settings.ks),
        "heldout_shards": [Path(p).stem for p in heldout_hidden],
        "simulated": simulated["eagle3"],
        "baselines": {
            "untrained": simulated["untrained"],
            "prompt_lookup": simulated["prompt_lookup"],
        },
        "live": None,
        "live_baselines": None,
        "live_skipped_reason": None,
        "definition": "acceptance length = 1 + accepted draft tokens per verification round",
    }


def engine_metrics(
    drafter_dir: str | Path, prompts: list[list[int]], cuts: list[DepthCut],
    settings: EvaluateSettings, runtime: VllmRuntime | None, model_dtype: str,
) -> dict[str, Any]:  # fmt: skip
    """vLLM's figures (evaluate.engine: vllm) from the held-out prompts and each depth cut, with
    the emitted tokens per round of every K on the one definition."""
    from eaglenest.stages.evaluate.vllm_evaluate import evaluate_in_vllm

    engine = evaluate_in_vllm(
        prompts=prompts, drafter_dir=drafter_dir,
        target_path=resolve_target_dir(settings.target.path), ks=settings.ks,
        max_new_tokens=settings.live_max_new_tokens, model_dtype=model_dtype,
        engine=settings.vllm, runtime=runtime,
        trust_remote_code=settings.target.trust_remote_code,
        depth_prompts={str(c.depth): c.prompts for c in cuts if c.prompts},
    )  # fmt: skip
    for per_k in [engine["per_k"], *(engine.get("by_depth") or {}).values()]:
        for engine_k in per_k.values():
            engine_k["emitted_per_round"] = emitted_per_round(
                engine_k["tokens"], engine_k["prompts"], engine_k["rounds"]
            )
    return engine


def live_vs_engine(live: dict[str, dict], engine: dict[str, dict]) -> dict[str, float | None]:
    """Per K: our live emitted tokens per round over the engine's, on that one definition."""
    ratios: dict[str, float | None] = {}
    for k, engine_k in engine.items():
        ours, theirs = live[k].get("emitted_per_round"), engine_k.get("emitted_per_round")
        ratios[k] = ours / theirs if ours is not None and theirs else None
    return ratios


def eos_token_ids(target_path: str | Path, target) -> set[int]:
    """End-of-generation ids: generation_config's eos (one or several), else the config's."""
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = target.config.eos_token_id
    if eos is None:
        config = json.loads((resolve_target_dir(target_path) / "config.json").read_text())
        eos = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
