"""The run's choice of drafter family: the one that emits the most tokens per unit of target time
at the depths the run's answers reach (docs/report.md, Drafter families).

Every figure is measured by the evaluate stage's own live loop, per family, K and depth
(eval{suffix}/metrics.json, `live` and `by_depth`):
- emitted tokens per round: the tokens the answers kept, less the one per prompt the prefill
  emits, over the verification rounds;
- the drafter's time per round: its propose and accept calls (K forwards for EAGLE-3, one for
  P-EAGLE and DFlash);
- the target's time per round: the round less the drafter's share (the verification forward);
- the target's plain greedy step: its decoding time per token, on the same prompts in the same job.

Tokens per target step = emitted per round / ((target + drafter time per round) / greedy step):
what a round emits per plain decoding step's worth of time it takes, which is the decoding
speed-up over plain greedy. Each family's is a ratio of times taken in one job, so families
evaluated in different jobs, under other loads of the machine, still compare; it charges a family
for the width of its verification (K + 1 tokens) and for its drafter. Tokens per second (the same
round over seconds) is kept beside it.

The depths the answers reach: the evaluate.depths where prompts were decoded (depth 0: from the
prompt; with no evaluate.depths, the held-out prompts alone), each weighted by the share of the
run's generated tokens (every tokenized sample's completion) whose position lies between it and
the next depth measured. A family's figure at a K is total tokens over total time across that
mix (a weighted harmonic mean); each family counts at its best K, and the highest is chosen.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import polars as pl

from eaglenest.formats.metrics import recorded_or_emitted

MEASURE = (
    "emitted tokens per round / ((target + drafter seconds per round) / target's greedy seconds "
    "per token), our own live loop, over the evaluate.depths measured weighted by the run's "
    "generated tokens between each depth and the next (a weighted harmonic mean)"
)


@dataclass(frozen=True)
class DepthFigures:
    """One family's figures at one K and depth (live unless named otherwise)."""

    depth: int
    prompts: int | None
    acceptance_length: float | None
    emitted_per_round: float | None
    engine_emitted_per_round: float | None
    simulated_acceptance_length: float | None
    drafter_s_per_round: float | None
    target_s_per_round: float | None
    greedy_s_per_token: float | None

    @property
    def round_s(self) -> float | None:
        if self.drafter_s_per_round is None or self.target_s_per_round is None:
            return None
        return self.drafter_s_per_round + self.target_s_per_round

    @property
    def tokens_per_s(self) -> float | None:
        round_s = self.round_s
        if self.emitted_per_round is None or not round_s or round_s <= 0:
            return None
        return self.emitted_per_round / round_s

    @property
    def tokens_per_target_step(self) -> float | None:
        per_s = self.tokens_per_s
        if per_s is None or not self.greedy_s_per_token:
            return None
        return per_s * self.greedy_s_per_token

    def as_dict(self) -> dict[str, Any]:
        figures = asdict(self)
        figures["tokens_per_s"] = self.tokens_per_s
        figures["tokens_per_target_step"] = self.tokens_per_target_step
        return figures


def _figures(depth: int, prompts, live: dict, engine: dict, simulated: dict) -> DepthFigures:
    return DepthFigures(
        depth=depth,
        prompts=prompts,
        acceptance_length=live.get("acceptance_length"),
        emitted_per_round=recorded_or_emitted(live),
        engine_emitted_per_round=recorded_or_emitted(engine),
        simulated_acceptance_length=simulated.get("acceptance_length"),
        drafter_s_per_round=live.get("drafter_s_per_round"),
        target_s_per_round=live.get("target_s_per_round"),
        greedy_s_per_token=live.get("greedy_s_per_token"),
    )


def depth_figures(metrics: dict[str, Any]) -> dict[str, list[DepthFigures]]:
    """K -> the family's figures by depth (eval metrics' `by_depth`; without it, one row at
    depth 0 from the held-out prompts' figures)."""
    per_k = (metrics.get("by_depth") or {}).get("per_k")
    if per_k:
        return {
            k: [
                _figures(
                    row["depth"],
                    row.get("prompts"),
                    row.get("live") or {},
                    row.get("engine") or {},
                    row.get("simulated") or {},
                )
                for row in rows
            ]
            for k, rows in per_k.items()
        }
    live = metrics.get("live") or {}
    engine = (metrics.get("engine") or {}).get("per_k") or {}
    out = {}
    for k in map(str, metrics["ks"]):
        live_k = live.get(k) or {}
        simulated = (metrics.get("simulated") or {}).get(k) or {}
        out[k] = [_figures(0, live_k.get("prompts"), live_k, engine.get(k) or {}, simulated)]
    return out


def depth_weights(tokens: pl.DataFrame | None, depths: list[int]) -> dict[int, float]:
    """Each depth's share of the run's generated tokens: those at generated depths from it to the
    next depth (below the first depth: the first's). Equal shares without token lengths."""
    depths = sorted(set(depths))
    if not depths:
        return {}
    if tokens is None or tokens.is_empty():
        return {d: 1 / len(depths) for d in depths}
    # generated depths 0 .. answer length (evaluate/depths.py)
    start = np.zeros(len(tokens))
    end = (tokens["n_tokens"] - tokens["prompt_len"]).to_numpy().astype(np.float64)
    counts = []
    for index, depth in enumerate(depths):
        low = -math.inf if index == 0 else depth
        high = depths[index + 1] if index + 1 < len(depths) else math.inf
        counts.append(float(np.clip(np.minimum(end, high) - np.maximum(start, low), 0, None).sum()))
    total = sum(counts)
    if total <= 0:
        return {d: 1 / len(depths) for d in depths}
    return {d: count / total for d, count in zip(depths, counts, strict=True)}


def mixed(rates: dict[int, float], weights: dict[int, float]) -> float | None:
    """Total tokens over total time across the depths: the weighted harmonic mean."""
    time = sum(weights[d] / rates[d] for d in rates if weights.get(d))
    weight = sum(weights[d] for d in rates if weights.get(d))
    return weight / time if time > 0 else None


def family_at_k(rows: list[DepthFigures], tokens: pl.DataFrame | None) -> dict[str, Any]:
    """One family at one K over the depths it was timed at, weighted by the run's answers."""
    timed = [r for r in rows if r.tokens_per_target_step is not None]
    weights = depth_weights(tokens, [r.depth for r in timed])
    steps = {r.depth: r.tokens_per_target_step for r in timed}
    seconds = {r.depth: r.tokens_per_s for r in timed}
    return {
        "tokens_per_target_step": mixed(steps, weights),
        "tokens_per_s": mixed(seconds, weights),
        "depth_weights": {str(d): w for d, w in weights.items()},
        "by_depth": [r.as_dict() for r in rows],
    }


def choose_family(families: dict[str, dict], tokens: pl.DataFrame | None) -> dict[str, Any]:
    """The choice among the evaluated `families` (family -> its eval metrics), in their order:
    report/summary.json's `choice` (null with `why_none` when no family was timed), `measure`
    and every family's figures at every K."""
    per_family: dict[str, Any] = {}
    best: tuple[float, str, str] | None = None
    for family, metrics in families.items():
        per_k = {k: family_at_k(rows, tokens) for k, rows in depth_figures(metrics).items()}
        timed = {k: v["tokens_per_target_step"] for k, v in per_k.items()}
        timed = {k: rate for k, rate in timed.items() if rate is not None}
        best_k = max(timed, key=timed.get) if timed else None
        per_family[family] = {"best_k": best_k, "per_k": per_k}
        if best_k is not None and (best is None or timed[best_k] > best[0]):
            best = (timed[best_k], family, best_k)
    summary: dict[str, Any] = {"measure": MEASURE, "families": per_family, "choice": None}
    if best is None:
        summary["why_none"] = why_none(families)
        return summary
    rate, family, k = best
    summary["choice"] = {
        "family": family,
        "k": int(k),
        "tokens_per_target_step": rate,
        "tokens_per_s": per_family[family]["per_k"][k]["tokens_per_s"],
        "depth_weights": per_family[family]["per_k"][k]["depth_weights"],
    }
    return summary


def why_none(families: dict[str, dict]) -> str:
    if not families:
        return "no drafter family evaluated yet (no eval*/metrics.json)"
    reasons = sorted({metrics.get("live_skipped_reason") or "" for metrics in families.values()})
    reasons = [r for r in reasons if r]
    if reasons:
        return "not decoded live, so no drafter or target time: " + "; ".join(reasons)
    return "the live figures carry no drafter and target time per round (evaluated before they did)"
