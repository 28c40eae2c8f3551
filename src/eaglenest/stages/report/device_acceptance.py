"""Each family's acceptance as the choice on the serving device counts it (device_choice.py):
emitted tokens per round (tau) from the evaluate stage's vLLM run, per K, over the depths the
run's answers reach, prompt by prompt for the bootstrap.

Per K, from eval{suffix}/metrics.json:
- vLLM at each depth where the engine decoded the depth cuts (the depth table's `engine` rows,
  `by_depth.per_k`), else the held-out prompts (`engine.per_k`, as depth 0); per prompt its emitted tokens (past the
  prefill's one) and its rounds (`emitted_per_prompt`, `rounds_per_prompt`), else the totals
  alone (no bootstrap);
- where vLLM has no figure at that K (it did not serve the family: `engine.not_served`, or no
  `evaluate.engine: vllm`), our live loop's emitted tokens per round by depth (the depth table's
  live rows, else the held-out prompts' `live`), the source saying so.

The depths weigh as in this machine's figures (choice.py `depth_weights`: the share of the run's
generated tokens from each depth to the next); the family's tau is total tokens over total rounds
across them (the weighted harmonic mean of the depths' tau: rounds cost the same at every depth,
so it is the mix of the tokens per target step too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from eaglenest.formats.metrics import recorded_or_emitted
from eaglenest.settings.families import family_spec
from eaglenest.stages.report.choice import depth_weights

# (depth, prompts) -> a bootstrap's draws of prompt indices: the same for every family at a depth
Draws = Callable[[int, int], np.ndarray]


@dataclass(frozen=True)
class DepthAcceptance:
    """Emitted tokens and rounds at one depth, per prompt (one entry: totals only)."""

    depth: int
    weight: float
    emitted: np.ndarray
    rounds: np.ndarray
    per_prompt: bool

    @property
    def tau(self) -> float:
        return float(self.emitted.sum() / self.rounds.sum())

    def resampled(self, draws: np.ndarray) -> np.ndarray:
        """tau of each draw (rows of prompt indices)."""
        return self.emitted[draws].sum(axis=1) / self.rounds[draws].sum(axis=1)


def harmonic(taus: list[Any], weights: list[float]) -> Any:
    """Total tokens over total rounds across depths weighted `weights` (numbers or arrays)."""
    kept = [(t, w) for t, w in zip(taus, weights, strict=True) if w > 0]
    return sum(w for _, w in kept) / sum(w / t for t, w in kept)


@dataclass(frozen=True)
class Acceptance:
    """One family's acceptance at one K, by depth."""

    family: str
    k: int
    depths: tuple[DepthAcceptance, ...]
    source: str  # "vllm", or "our live loop (why vLLM has no figure)"

    @property
    def tau(self) -> float:
        return float(harmonic([d.tau for d in self.depths], [d.weight for d in self.depths]))

    @property
    def per_prompt(self) -> bool:
        return all(d.per_prompt for d in self.depths)

    def prompts(self) -> int | None:
        return sum(len(d.rounds) for d in self.depths) if self.per_prompt else None

    def drafter_forwards(self) -> int:
        return 1 if family_spec(self.family).parallel else self.k

    def resampled_tau(self, draws: Draws) -> np.ndarray:
        """The family's tau in each bootstrap resample: each depth's prompts drawn by `draws`."""
        taus = [d.resampled(draws(d.depth, len(d.rounds))) for d in self.depths]
        return harmonic(taus, [d.weight for d in self.depths])

    def summary(self) -> dict[str, Any]:
        return {
            "emitted_per_round": self.tau,
            "acceptance_source": self.source,
            "prompts": self.prompts(),
            "by_depth": {str(d.depth): {"tau": d.tau, "weight": d.weight} for d in self.depths},
        }


def counts(figures: dict[str, Any] | None) -> tuple[list, list, bool] | None:
    """(emitted, rounds, per prompt) of one figure: per prompt where kept, else its emitted tokens
    per round alone (as recorded, else from its tokens, prompts and rounds); None without."""
    if not figures:
        return None
    emitted, rounds = figures.get("emitted_per_prompt"), figures.get("rounds_per_prompt")
    if emitted and rounds and len(emitted) == len(rounds) and sum(rounds) > 0:
        return list(emitted), list(rounds), True
    tau = recorded_or_emitted(figures)
    return None if tau is None else ([tau], [1], False)


def engine_by_depth(metrics: dict[str, Any], k: str) -> dict[int, tuple]:
    """depth -> vLLM's counts at K: the depth table's engine rows (`by_depth.per_k`), else the
    held-out prompts' (`engine.per_k`) as depth 0."""
    rows = ((metrics.get("by_depth") or {}).get("per_k") or {}).get(k) or []
    found = {}
    for row in rows:
        if (each := counts(row.get("engine"))) is not None:
            found[int(row["depth"])] = each
    engine = metrics.get("engine") or {}
    if not found and (each := counts((engine.get("per_k") or {}).get(k))) is not None:
        found[0] = each
    return found


def live_by_depth(metrics: dict[str, Any], k: str) -> dict[int, tuple]:
    """depth -> our live loop's counts at K: the depth table's live rows, else `live` at 0."""
    rows = ((metrics.get("by_depth") or {}).get("per_k") or {}).get(k) or []
    found = {}
    for row in rows:
        if (each := counts(row.get("live"))) is not None:
            found[int(row["depth"])] = each
    if not found and (each := counts((metrics.get("live") or {}).get(k))) is not None:
        found[0] = each
    return found


def why_not_vllm(metrics: dict[str, Any], k: str) -> str:
    engine = metrics.get("engine") or {}
    if not engine:
        return "no vLLM run: evaluate.engine is not vllm"
    return (engine.get("not_served") or {}).get(k) or "vLLM did not serve it"


def family_acceptance(
    family: str, metrics: dict[str, Any], tokens: pl.DataFrame | None
) -> dict[str, Acceptance]:
    """K -> the family's acceptance over the depths (vLLM's, else our live loop's, said so),
    each depth weighted by the run's generated tokens `tokens` (equal shares without)."""
    found = {}
    for k in map(str, metrics.get("ks") or []):
        by_depth, source = engine_by_depth(metrics, k), "vllm"
        if not by_depth:
            by_depth = live_by_depth(metrics, k)
            source = f"our live loop ({why_not_vllm(metrics, k)})"
        if not by_depth:
            continue
        weights = depth_weights(tokens, list(by_depth))
        depths = tuple(
            DepthAcceptance(
                depth,
                weights[depth],
                np.asarray(emitted, dtype=np.float64),
                np.asarray(rounds, dtype=np.float64),
                per_prompt,
            )
            for depth, (emitted, rounds, per_prompt) in sorted(by_depth.items())
        )
        found[k] = Acceptance(family, int(k), depths, source)
    return found
