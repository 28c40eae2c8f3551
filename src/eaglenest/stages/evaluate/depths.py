"""Acceptance by generated depth (`evaluate.depths`): held-out samples cut at each depth, and the
table eval/metrics.json keeps of what each way of measuring found there.

A drafter's acceptance depends on how deep into a long answer it drafts. For each depth d the
held-out samples are cut after their prompt and the first d tokens of their answer (as token ids:
the prompt of the live and of the engine decoding is the sample up to there) and the target's
greedy continuation is decoded from there, `evaluate.live_max_new_tokens` tokens, with the
drafter proposing; depth 0 is the sample's own prompt (its answer from the start). Depth counts
generated tokens, not the context's: a long system prompt does not move a depth, and depth d
drafts what the target generates after d tokens of its own, as a served answer does. A sample is
skipped, and counted, when its answer is shorter than d + the continuation (`too_short`).
Simulated acceptance per depth counts the answer's positions at or past d of every held-out
sample, and (`window`) only those the decoding from the cut covers (simulated.decoded_window):
like with like beside the live and engine rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from eaglenest.formats.metrics import DepthEngineFigures, DepthLiveFigures, DepthRow, DepthTable


@dataclass
class DepthCut:
    """The prompts cut at one depth, and how many samples were skipped there and why."""

    depth: int
    prompts: list[list[int]] = field(default_factory=list)
    too_short: int = 0

    def counts(self) -> dict[str, int]:
        return {"prompts": len(self.prompts), "too_short": self.too_short}


def cut_sample(
    input_ids: list[int], prompt_len: int, depth: int, continuation: int
) -> str | list[int]:
    """The sample's prompt and the first `depth` tokens of its answer, or "too_short" when its
    answer does not go on `continuation` tokens past them."""
    cut = prompt_len + depth
    if len(input_ids) < cut + continuation:
        return "too_short"
    return list(input_ids[:cut])


def cut_at_depths(
    tokens_paths: list[str | Path], depths: tuple[int, ...], per_depth: int, continuation: int
) -> list[DepthCut]:
    """For each depth, the first `per_depth` held-out samples (in shard order) cut there."""
    cuts = [DepthCut(d) for d in depths]
    for path in tokens_paths:
        frame = pl.read_parquet(path, columns=["input_ids", "prompt_len"])
        for ids, prompt_len in frame.iter_rows():
            for cut in cuts:
                if len(cut.prompts) == per_depth:
                    continue
                prompt = cut_sample(ids, prompt_len, cut.depth, continuation)
                if isinstance(prompt, str):
                    setattr(cut, prompt, getattr(cut, prompt) + 1)
                else:
                    cut.prompts.append(prompt)
    return cuts


COUNTED = ("acceptance_length", "emitted_per_round", "rounds", "tokens", "prompts")


def _live_row(figures: dict[str, Any] | None) -> DepthLiveFigures | None:
    if not figures:
        return None
    return DepthLiveFigures(
        **{key: figures.get(key) for key in COUNTED},
        identical_to_greedy=figures.get("identical_to_greedy"),
        # A family's drafter time a round at this depth (a block in one forward, or K forwards).
        drafter_s_per_round=figures.get("drafter_s_per_round"),
        # The target's: its verification a round, and its plain greedy step (the report's unit).
        target_s_per_round=figures.get("target_s_per_round"),
        greedy_s_per_token=figures.get("greedy_s_per_token"),
        # Per prompt: its acceptance length and rounds (the report's interval over prompts).
        per_prompt=figures.get("per_prompt"),
        rounds_per_prompt=figures.get("rounds_per_prompt"),
    )


def _engine_row(figures: dict[str, Any] | None) -> DepthEngineFigures | None:
    if not figures:
        return None
    return DepthEngineFigures(
        **{key: figures.get(key) for key in COUNTED},
        identical_to_plain=figures.get("identical_to_plain"),
        # Its temperature and its spread over prompts (stages/evaluate/spread.py), where measured.
        temperature=figures.get("temperature"),
        ci95=(figures.get("spread") or {}).get("ci95"),
        per_prompt=(figures.get("spread") or {}).get("per_prompt"),
        rounds_per_prompt=figures.get("rounds_per_prompt"),
        emitted_per_prompt=figures.get("emitted_per_prompt"),
    )


def _simulated_row(figures: dict[str, Any] | None) -> dict[str, Any] | None:
    """The simulated figures past the depth, and over the decoded window where measured
    (simulated.decoded_window: the positions the live and engine rows decode)."""
    if not figures:
        return None
    row = {key: figures[key] for key in ("acceptance_length", "positions")}
    if "window" in figures:
        row["window"] = {key: figures["window"][key] for key in ("acceptance_length", "positions")}
    return row


def depth_table(
    cuts: list[DepthCut],
    ks: tuple[int, ...],
    continuation: int,
    simulated: dict[str, dict[str, Any]],
    live: dict[str, dict[str, Any]] | None,
    engine: dict[str, dict[str, Any]] | None,
    engine_sampled: dict[str, dict[str, Any]] | None = None,
) -> DepthTable:
    """eval/metrics.json's `by_depth`: per K, one row per depth with the prompts decoded there
    and the acceptance (length, rounds) of the simulated, live and engine measurements, and of
    the engine's sampled decoding (`engine_sampled`, at the generation temperature).

    `simulated`, `live`, `engine`, `engine_sampled`: depth (str) -> K (str) -> that
    measurement's figures."""
    per_k: dict[str, list[DepthRow]] = {}
    for k in map(str, ks):
        rows = []
        for cut in cuts:
            d = str(cut.depth)
            sim = (simulated.get(d) or {}).get(k)
            rows.append(
                DepthRow(
                    depth=cut.depth,
                    prompts=len(cut.prompts),
                    simulated=_simulated_row(sim),
                    live=_live_row(((live or {}).get(d) or {}).get(k)),
                    engine=_engine_row(((engine or {}).get(d) or {}).get(k)),
                    engine_sampled=_engine_row(((engine_sampled or {}).get(d) or {}).get(k)),
                )
            )
        per_k[k] = rows
    return DepthTable(
        depths=[cut.depth for cut in cuts],
        continuation_tokens=continuation,
        samples={str(cut.depth): cut.counts() for cut in cuts},
        per_k=per_k,
        definition=(
            "held-out samples cut after their prompt and `depth` generated tokens (depth 0: the "
            "sample's prompt), the continuation decoded greedily with the drafter "
            "(engine_sampled: by the engine at the generation temperature); simulated: the "
            "answer's positions >= depth of every held-out sample"
        ),
    )
