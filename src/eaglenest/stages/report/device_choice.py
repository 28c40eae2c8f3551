"""The run's choice of drafter family on the serving device (report.device; docs/report.md,
Drafter families): acceptance from the serving engine, times from the device.

Per family and K: tokens per target step = tau / (v(K) + d * r), where
- tau: emitted tokens per round in the evaluate stage's vLLM run (greedy), over the depths the
  run's answers reach (device_acceptance.py: each evaluate.depths cut, weighted as this
  machine's figures are; the held-out prompts without depth cuts); where vLLM did not serve the
  family at that K, our own live loop's, and the figure says so;
- v(K): the device's cost of verifying K + 1 tokens in one target forward over one plain decode
  step (report.device.verify_cost);
- d: the drafter's forwards per round (EAGLE-3 K, P-EAGLE and DFlash one: FamilySpec.parallel);
- r: one drafter forward over one target decode step on the device (report.device.drafter_ratio,
  or the family's own in family_ratios).

Each family counts at its best K on the device, the highest is chosen. The curve: each family at
its best K at each r from R_MIN to R_MAX (log-spaced; a K-forward drafter's K falls as r grows),
every family's ratio scaled by r over the device's drafter_ratio (so their own ratios keep their
proportion); the crossovers: the r in (0, 1] where the best family changes, and a family's
k_changes where its best K does, solved exactly (two (family, K) lines meet where
tau_a (v_b + d_b s_b r) = tau_b (v_a + d_a s_a r), s the family's ratio over the device's).
The margin of the chosen family over the second at the device's ratio has a bootstrap interval
over prompts (RESAMPLES draws at each depth, seeded by SEED, the depth and the prompt count; two
families decoded at a depth with as many prompts, the same cut prompts, get the same draws, so
the prompts' difficulty cancels: `paired`).

Without report.device there is no choice: this machine's live loop (choice.py) is reported as
what it is, its own timings. The curve and its crossovers are still drawn from vLLM's acceptance,
under a stated assumption in place of the device's figures (ASSUMED: verifying K + 1 tokens costs
one decode step, as on a GPU at low concurrency; every family's K picked at r = ASSUMED_RATIO), so
a user reads off the ratio where the families cross and sees where their own device falls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import polars as pl

from eaglenest.settings.report import DeviceTimings
from eaglenest.stages.report.device_acceptance import Acceptance, Draws, family_acceptance

R_MIN, R_MAX, CURVE_POINTS = 0.002, 0.5, 61
RESAMPLES = 2000
SEED = 0
DEVICE_MEASURE = (
    "tokens per target step on the serving device = emitted tokens per round (vLLM, greedy, over "
    "the evaluate.depths weighted by the run's generated tokens between each depth and the next) "
    "/ (verify cost of K + 1 tokens + drafter forwards per round * drafter / target forward-time "
    "ratio), each family at its best K"
)
WHY_NO_DEVICE = (
    "no serving device's timings (report.device): this machine's live loop (Python at batch 1 "
    "on its CPU cores) times a drafter forward at a far larger share of the target's step than "
    "a GPU beside a large target does, so it cannot choose a family for one"
)


# Without report.device: the curve's assumption (a GPU at low concurrency verifies K + 1 tokens in
# about one decode step's time; beside a large target a drafter forward is a few percent of it).
ASSUMED_VERIFY_COST = 1.0
ASSUMED_RATIO = 0.05
ASSUMED = (
    f"no device timings: verifying K + 1 tokens taken to cost one decode step (v = "
    f"{ASSUMED_VERIFY_COST:g}, a GPU at low concurrency), every family's drafter at the same "
    f"ratio r, each at its best K at each r (the table's at r = {ASSUMED_RATIO:g}); no family is "
    "chosen from it"
)


def assumed_device(acceptance: dict[str, dict[str, Acceptance]]) -> DeviceTimings:
    """The stand-in device of the curve without report.device (ASSUMED)."""
    ks = {k for per_k in acceptance.values() for k in per_k}
    return DeviceTimings(
        name="assumed",
        source=ASSUMED,
        drafter_ratio=ASSUMED_RATIO,
        family_ratios={},
        verify_cost={k: ASSUMED_VERIFY_COST for k in sorted(ks, key=int)},
    )


def steps_per_round(each: Acceptance, device: DeviceTimings, ratio: float) -> float:
    """A round's time in target decode steps: verify K + 1, plus d drafter forwards at `ratio`."""
    return device.verify_cost[str(each.k)] + each.drafter_forwards() * ratio


def tokens_per_step(each: Acceptance, device: DeviceTimings) -> float:
    """tau / (v(K) + d r) at the device's ratio of the family."""
    return each.tau / steps_per_round(each, device, device.ratio(each.family))


def timed(each: Acceptance, device: DeviceTimings) -> bool:
    """Whether the device has a verify cost at each's K and the rate it gives is finite: a NaN
    (a timings object built past check_timings, a NaN tau) loses every comparison both ways, so
    `max` would keep or drop it by its place in the list, and it never counts in a choice."""
    return str(each.k) in device.verify_cost and math.isfinite(tokens_per_step(each, device))


def best_at_device(
    acceptance: dict[str, dict[str, Acceptance]], device: DeviceTimings
) -> tuple[dict[str, Acceptance], dict[str, Any]]:
    """Each family at its best K on the device (those with a verify cost), and every K's figures."""
    best, table = {}, {}
    for family, per_k in acceptance.items():
        rows = {}
        for k, each in per_k.items():
            rows[k] = {
                **each.summary(),
                "drafter_forwards": each.drafter_forwards(),
                "drafter_ratio": device.ratio(family),
                "verify_cost": device.verify_cost.get(k),
                "tokens_per_target_step": tokens_per_step(each, device)
                if timed(each, device)
                else None,
            }
        counted = [k for k in per_k if rows[k]["tokens_per_target_step"] is not None]
        if counted:
            k = max(counted, key=lambda k: rows[k]["tokens_per_target_step"])
            best[family] = per_k[k]
        table[family] = {"best_k": int(best[family].k) if family in best else None, "per_k": rows}
    return best, table


def _line(each: Acceptance, device: DeviceTimings) -> tuple[float, float]:
    """The family's round in steps as a + b r (r the device axis): (a, b)."""
    scale = device.ratio(each.family) / device.drafter_ratio
    return device.verify_cost[str(each.k)], each.drafter_forwards() * scale


def crossing(a: Acceptance, b: Acceptance, device: DeviceTimings) -> float | None:
    """The r where a's and b's tokens per target step are equal (None: parallel or the same)."""
    (va, da), (vb, db) = _line(a, device), _line(b, device)
    denominator = a.tau * db - b.tau * da
    if denominator == 0:
        return None
    return (b.tau * va - a.tau * vb) / denominator


def rate_at(each: Acceptance, device: DeviceTimings, r: float) -> float:
    v, d = _line(each, device)
    return each.tau / (v + d * r)


def timed_options(
    acceptance: dict[str, dict[str, Acceptance]], device: DeviceTimings
) -> dict[str, list[Acceptance]]:
    """Each family's K with a verify cost on the device (the K it may pick at any r)."""
    options = {
        family: [each for each in per_k.values() if timed(each, device)]
        for family, per_k in acceptance.items()
    }
    return {family: found for family, found in options.items() if found}


def best_k_at(options: list[Acceptance], device: DeviceTimings, r: float) -> Acceptance:
    """The family's K with the most tokens per target step at r (the lowest K on a tie)."""
    return max(sorted(options, key=lambda each: each.k), key=lambda e: rate_at(e, device, r))


def leader(options: dict[str, list[Acceptance]], device: DeviceTimings, r: float) -> Acceptance:
    """The family, at its best K at r, with the most tokens per target step at r."""
    return max(
        (best_k_at(found, device, r) for found in options.values()),
        key=lambda each: rate_at(each, device, r),
    )


def changes(
    lines: list[Acceptance], device: DeviceTimings, best: Callable[[float], Acceptance]
) -> list[tuple[float, Acceptance, Acceptance]]:
    """The r in (0, 1] where `best(r)` changes, with the best just below and just above. The
    best of straight-line rates changes only where two of them meet, so every meeting point of
    two `lines` is tried: exact, not sampled."""
    points = sorted(
        {
            r
            for i, a in enumerate(lines)
            for b in lines[i + 1 :]
            if (r := crossing(a, b, device)) is not None and 0 < r <= 1
        }
    )
    found = []
    for r in points:
        below, above = best(r * (1 - 1e-9)), best(r * (1 + 1e-9))
        if (below.family, below.k) != (above.family, above.k):
            found.append((r, below, above))
    return found


def crossovers(options: dict[str, list[Acceptance]], device: DeviceTimings) -> list[dict[str, Any]]:
    """The r in (0, 1] where the best family changes, in order: the family best below and above,
    each at its best K there (K re-picked along r)."""
    lines = [each for found in options.values() for each in found]
    found = []
    for r, below, above in changes(lines, device, lambda r: leader(options, device, r)):
        if below.family != above.family:
            found.append(
                {
                    "ratio": r,
                    "below": below.family,
                    "above": above.family,
                    "k_below": below.k,
                    "k_above": above.k,
                }
            )
    return found


def k_changes(found: list[Acceptance], device: DeviceTimings) -> list[dict[str, Any]]:
    """The r in (0, 1] where a family's best K changes (a K-forward drafter's K falls as r grows)."""
    return [
        {"ratio": r, "k_below": below.k, "k_above": above.k}
        for r, below, above in changes(found, device, lambda r: best_k_at(found, device, r))
    ]


def curve(
    options: dict[str, list[Acceptance]], best: dict[str, Acceptance], device: DeviceTimings
) -> dict[str, Any]:
    """Each family at its best K at each r against r, R_MIN to R_MAX log-spaced: `k` its best K
    at the device's ratio, `ks` at each r, `k_changes` where that K changes."""
    ratios = np.geomspace(R_MIN, R_MAX, CURVE_POINTS)
    families = {}
    for family, found in options.items():
        at = [best_k_at(found, device, float(r)) for r in ratios]
        families[family] = {
            "k": best[family].k,
            "ks": [each.k for each in at],
            "k_changes": k_changes(found, device),
            "tokens_per_target_step": [
                rate_at(each, device, float(r)) for each, r in zip(at, ratios, strict=True)
            ],
        }
    return {
        "ratios": [float(r) for r in ratios],
        "device_ratio": device.drafter_ratio,
        "families": families,
    }


def resampled_rates(each: Acceptance, device: DeviceTimings, draws: Draws) -> np.ndarray:
    return each.resampled_tau(draws) / steps_per_round(each, device, device.ratio(each.family))


def bootstrap_draws() -> Draws:
    """(depth, prompts) -> RESAMPLES rows of prompt indices, drawn once for each pair: every
    family decoded at a depth with as many prompts (the same cut prompts) gets the same draws."""
    made: dict[tuple[int, int], np.ndarray] = {}

    def draws(depth: int, prompts: int) -> np.ndarray:
        if (depth, prompts) not in made:
            rng = np.random.default_rng([SEED, depth, prompts])
            made[depth, prompts] = rng.integers(0, prompts, size=(RESAMPLES, prompts))
        return made[depth, prompts]

    return draws


def margin(first: Acceptance, second: Acceptance, device: DeviceTimings) -> dict[str, Any]:
    """first's tokens per target step less second's at the device, with a 95% bootstrap
    interval over prompts (paired where both answered as many prompts at every depth)."""
    difference = tokens_per_step(first, device) - tokens_per_step(second, device)
    found: dict[str, Any] = {
        "over": second.family,
        "tokens_per_target_step": difference,
        "relative": tokens_per_step(first, device) / tokens_per_step(second, device) - 1,
        "ci95": None,
        "resamples": RESAMPLES,
        "seed": SEED,
        "paired": None,
    }
    if not (first.per_prompt and second.per_prompt):
        found["why_no_interval"] = "no per-prompt figures (vLLM's per-request record) for both"
        return found
    draws = bootstrap_draws()
    differences = resampled_rates(first, device, draws) - resampled_rates(second, device, draws)
    found["ci95"] = [float(v) for v in np.percentile(differences, [2.5, 97.5])]
    found["paired"] = [len(d.rounds) for d in first.depths] == [
        len(d.rounds) for d in second.depths
    ]
    found["share_ahead"] = float(np.mean(differences > 0))
    return found


def device_summary(device: DeviceTimings) -> dict[str, Any]:
    return {
        "name": device.name,
        "source": device.source,
        "drafter_ratio": device.drafter_ratio,
        "family_ratios": device.family_ratios,
        "verify_cost": device.verify_cost,
    }


def choose_on_device(
    families: dict[str, dict], device: DeviceTimings | None, tokens: pl.DataFrame | None = None
) -> dict[str, Any]:
    """report/summary.json's device figures and `choice` (null with `why_none`): the device, the
    measure, each family's figures per K, the curve, the crossovers and the margin. `tokens`:
    the run's token lengths, which weigh the depths (device_acceptance.py)."""
    summary: dict[str, Any] = {"device": None, "measure": DEVICE_MEASURE, "choice": None}
    acceptance = {family: family_acceptance(family, m, tokens) for family, m in families.items()}
    if device is None:
        summary["why_none"] = WHY_NO_DEVICE
        assumed = assumed_device(acceptance)
        best, table = best_at_device(acceptance, assumed)
        if best:
            options = timed_options(acceptance, assumed)
            curve_of = {**curve(options, best, assumed), "device_ratio": None, "assumed": ASSUMED}
            found = crossovers(options, assumed)
            summary.update(by_family=table, curve=curve_of, crossovers=found)
        return summary
    best, table = best_at_device(acceptance, device)
    summary.update(device=device_summary(device), by_family=table)
    if not best:
        why = "no family has an acceptance at a K report.device.verify_cost lists"
        return {**summary, "why_none": why if families else "no drafter family evaluated yet"}
    ranked = sorted(best, key=lambda family: tokens_per_step(best[family], device), reverse=True)
    first = best[ranked[0]]
    summary["choice"] = {
        "family": first.family,
        "k": first.k,
        "tokens_per_target_step": tokens_per_step(first, device),
        "acceptance_source": first.source,
        "device": device.name,
        "timings_source": device.source,
        "margin": margin(first, best[ranked[1]], device) if len(ranked) > 1 else None,
    }
    options = timed_options(acceptance, device)
    summary.update(curve=curve(options, best, device), crossovers=crossovers(options, device))
    return summary
