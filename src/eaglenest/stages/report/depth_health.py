"""Depth health (report/summary.json `depth_health`, and a "Depth health" block in each family's
acceptance section): whether a family's acceptance collapses deep in the answer, where, of which
kind, and which config keys fix it (docs/report.md, Depth health; /work/shared/DEPTH.md).

Per family, at its smallest K with a depth table (the report has no other headline K; the
smallest is the one every family serves), from eval{suffix}/metrics.json `by_depth`:
- **Source**: vLLM's rows (`engine`) where it decoded at least two depths (or as many as our live
  loop), else our live loop's.
- **Acceptance and interval** per depth: the row's acceptance length, with a 95 % bootstrap
  interval over its prompts (each prompt's acceptance length and rounds, `per_prompt` and
  `rounds_per_prompt`: each draw's pooled 1 + accepted / rounds, as the figure itself is pooled;
  INTERVAL_DRAWS draws seeded by the depth, so the same figures give the same interval). Without
  per-prompt figures, the engine's own `ci95` where it has one, else no interval (the point).
- **Ratio**: acceptance at the depth over the earliest depth's; `ratio_interval` = [lo / hi0,
  hi / lo0] of the two intervals ([lo, hi] the depth's, [lo0, hi0] the earliest's).
- **Collapse** at depth d when the ratio's interval lies wholly below `report.collapse_ratio`
  (hi < ratio × lo0): noise at either depth cannot call it. `collapse_at` = the first such depth.
- **Kind** of a collapse at d (p the measured depth before it): `step` when the fall happened
  within that one interval (ratio at p >= (1 + collapse_ratio) / 2), to near 1 (d keeps at most
  NEAR_ONE of the earliest depth's accepted drafts per round) and a configured position lies in
  (p, d + continuation] (the decoding from d reaches it): the drafter's max_position_embeddings,
  sliding_window or rope scaling's original_max_position_embeddings (its config.json), or the
  largest position training reached (`max_position_trained`, train_report.json). Any other
  collapse is `decay`: learned, from what training never showed, however sharp.
"""

from __future__ import annotations

import html
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from eaglenest.stages.report.data import RunData
from eaglenest.stages.report.family_files import FAMILY_TITLES
from eaglenest.stages.report.page import table

INTERVAL_DRAWS = 2000  # bootstrap resamples, as the family choice draws
NEAR_ONE = 0.25  # a step ends with at most this share of the earliest depth's accepted drafts
# What training never showed is fixed by what it trains on: windows over the whole answer.
SEQUENCE_FIX = ("train.sequence.mode", "train.sequence.length")
ROPE_FIX = ("train.drafter.rope_theta", "the target's rope scaling (target.path config.json)")


@dataclass(frozen=True)
class Position:
    """A position a drafter is configured (or was trained) up to, and the keys that move it."""

    key: str
    value: int
    file: str
    fix: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "file": self.file}


@dataclass(frozen=True)
class DepthPoint:
    depth: int
    acceptance: float
    interval: list[float] | None
    prompts: int | None

    @property
    def bounds(self) -> tuple[float, float]:
        return tuple(self.interval) if self.interval else (self.acceptance, self.acceptance)


def _int(value: Any) -> int | None:
    if isinstance(value, list):  # one window per layer: the narrowest is the first cliff
        value = min((v for v in value if isinstance(v, int)), default=None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def configured_positions(
    drafter_config: dict[str, Any] | None, train_report: dict[str, Any] | None
) -> list[Position]:
    """The positions a step may sit at, in the order they are named when several fit."""
    config = drafter_config or {}
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    found = [
        (
            "max_position_embeddings",
            config.get("max_position_embeddings"),
            "config.json",
            ("train.drafter.max_position_embeddings",),
        ),
        (
            "sliding_window",
            config.get("sliding_window"),
            "config.json",
            ("train.drafter.sliding_window",),
        ),
        (
            "rope_scaling.original_max_position_embeddings",
            rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None,
            "config.json",
            ROPE_FIX,
        ),
        (
            "max_position_trained",
            (train_report or {}).get("max_position_trained"),
            "train_report.json",
            SEQUENCE_FIX,
        ),
    ]
    return [Position(k, _int(v), f, fix) for k, v, f, fix in found if _int(v) is not None]


def bootstrap_interval(
    lengths: list[float | None], rounds: list[int] | None, depth: int
) -> list[float] | None:
    """95 % bootstrap interval of the pooled acceptance length over prompts (None: no prompt)."""
    weighted = rounds is not None and len(rounds) == len(lengths)
    pairs = [
        (length, rounds[i] if weighted else 1)
        for i, length in enumerate(lengths)
        if length is not None
    ]
    if not pairs:
        return None
    length = np.array([p[0] for p in pairs], dtype=np.float64)
    weight = np.array([p[1] for p in pairs], dtype=np.float64)
    draws = np.random.default_rng(depth).integers(0, len(pairs), size=(INTERVAL_DRAWS, len(pairs)))
    totals = weight[draws].sum(axis=1)
    pooled = 1 + ((length - 1) * weight)[draws].sum(axis=1) / np.where(totals > 0, totals, 1)
    return [round(float(v), 4) for v in np.percentile(pooled, [2.5, 97.5])]


def _point(row: dict[str, Any], figures: dict[str, Any]) -> DepthPoint:
    per_prompt = figures.get("per_prompt")
    if per_prompt:
        interval = bootstrap_interval(per_prompt, figures.get("rounds_per_prompt"), row["depth"])
        prompts = sum(length is not None for length in per_prompt)
    else:
        interval, prompts = figures.get("ci95"), figures.get("prompts") or row.get("prompts")
    return DepthPoint(row["depth"], float(figures["acceptance_length"]), interval, prompts)


def depth_points(rows: list[dict[str, Any]]) -> tuple[str | None, list[DepthPoint]]:
    """(source, each depth measured in order): vLLM's where it has two depths, else live."""
    by_source = {}
    for source, key in (("vllm", "engine"), ("live", "live")):
        measured = [
            (row, row[key])
            for row in rows
            if (row.get(key) or {}).get("acceptance_length") is not None
        ]
        by_source[source] = sorted(
            (_point(row, figures) for row, figures in measured), key=lambda p: p.depth
        )
    if len(by_source["vllm"]) >= 2 or len(by_source["vllm"]) >= len(by_source["live"]):
        return ("vllm" if by_source["vllm"] else None), by_source["vllm"]
    return "live", by_source["live"]


def headline_k(by_depth: dict[str, Any]) -> str | None:
    """The smallest K whose depth table has a figure."""
    ks = [
        k
        for k, rows in (by_depth.get("per_k") or {}).items()
        if any(row.get("engine") or row.get("live") for row in rows)
    ]
    return min(ks, key=int) if ks else None


def judge(
    points: list[DepthPoint], threshold: float, positions: list[Position], continuation: int
) -> dict[str, Any]:
    """collapse_at, kind, position and fix of the depths measured (the module's rule)."""
    first = points[0]
    for previous, point in itertools.pairwise(points):
        # The depth's highest against the earliest's lowest: noise at either cannot call it.
        if point.bounds[1] >= threshold * first.bounds[0]:
            continue
        fell_in_one = previous.acceptance / first.acceptance >= (1 + threshold) / 2
        near_one = point.acceptance - 1 <= NEAR_ONE * (first.acceptance - 1)
        reach = (previous.depth, point.depth + continuation)
        at = next((p for p in positions if reach[0] < p.value <= reach[1]), None)
        if fell_in_one and near_one and at is not None:
            return {"collapse_at": point.depth, "kind": "step", "position": at, "fix": at.fix}
        return {"collapse_at": point.depth, "kind": "decay", "position": None, "fix": SEQUENCE_FIX}
    return {"collapse_at": None, "kind": None, "position": None, "fix": ()}


def family_health(
    metrics: dict[str, Any] | None,
    drafter_config: dict[str, Any] | None,
    train_report: dict[str, Any] | None,
    threshold: float,
) -> dict[str, Any]:
    """One family's `depth_health` entry (summary.json), with its sentence (`message`)."""
    by_depth = (metrics or {}).get("by_depth") or {}
    k = headline_k(by_depth)
    source, points = depth_points(by_depth["per_k"][k]) if k is not None else (None, [])
    entry: dict[str, Any] = {
        "collapse_at": None,
        "kind": None,
        "source": source,
        "k": int(k) if k is not None else None,
        "threshold": threshold,
        "by_depth": {},
        "position": None,
        "fix": [],
    }
    for point in points:
        (lo, hi), (lo0, hi0) = point.bounds, points[0].bounds
        entry["by_depth"][str(point.depth)] = {
            "acceptance": point.acceptance,
            "interval": point.interval,
            "ratio": _over(point.acceptance, points[0].acceptance),
            "ratio_interval": [_over(lo, hi0), _over(hi, lo0)],
            "prompts": point.prompts,
        }
    if len(points) < 2:
        entry["reason"] = f"{len(points)} depth measured: a fall needs two (evaluate.depths)"
    elif points[0].acceptance <= 1:
        entry["reason"] = "no draft accepted at the earliest depth: nothing to fall from"
    else:
        verdict = judge(
            points,
            threshold,
            configured_positions(drafter_config, train_report),
            by_depth.get("continuation_tokens") or 0,
        )
        position = verdict["position"]
        entry.update(
            collapse_at=verdict["collapse_at"],
            kind=verdict["kind"],
            position=position.as_dict() if position else None,
            fix=list(verdict["fix"]),
        )
    entry["message"] = sentence(entry, points)
    return entry


def _over(value: float, earliest: float) -> float | None:
    return value / earliest if earliest > 0 else None  # a malformed figure: no ratio, no crash


def depth_health(data: RunData, threshold: float) -> dict[str, dict[str, Any]]:
    """summary.json `depth_health`: every evaluated family's entry."""
    return {
        family: family_health(run.eval, run.drafter_config, run.train_report, threshold)
        for family, run in data.families.items()
        if run.eval is not None
    }


def sentence(entry: dict[str, Any], points: list[DepthPoint]) -> str:
    where = f"K={entry['k']}, {entry['source']}"
    if "reason" in entry:
        return f"Depth health not judged ({where}): {entry['reason']}."
    first, threshold = points[0].depth, entry["threshold"]
    unsure = "" if all(p.interval for p in points) else " (a depth without an interval: its point)"
    if entry["collapse_at"] is None:
        return (
            f"No collapse ({where}): at no depth does the 95% interval fall wholly below "
            f"{threshold}x depth {first}'s acceptance{unsure}."
        )
    if entry["kind"] == "step":
        position = entry["position"]
        cause = (
            f"a fall to near 1 within one depth interval, at the drafter's {position['key']} = "
            f"{position['value']} ({position['file']})"
        )
    else:
        cause = "learned, from what training never showed"
    keys = ", ".join(entry["fix"])
    if entry["fix"] == list(SEQUENCE_FIX):
        keys = "train.sequence.mode: windows, train.sequence.length"
    return (
        f"Collapse at depth {entry['collapse_at']} ({where}): below {threshold}x depth "
        f"{first}'s acceptance{unsure}; {entry['kind']}: {cause}. Fix: {keys}."
    )


def health_html(entry: dict[str, Any] | None, family: str) -> str:
    """The acceptance section's "Depth health" block of one family."""
    if entry is None:
        return ""
    rows = [
        [
            depth,
            each["prompts"],
            each["acceptance"],
            each["interval"],
            each["ratio"],
            each["ratio_interval"],
        ]
        for depth, each in entry["by_depth"].items()
    ]
    header = [
        "depth",
        "prompts",
        "acceptance length",
        "95% interval",
        "ratio to the first",
        "ratio interval",
    ]
    title = f"<h3>Depth health ({html.escape(FAMILY_TITLES[family])})</h3>"
    block = table(header, rows) if rows else ""
    return f"{title}{block}<p><strong>{html.escape(entry['message'])}</strong></p>"
