"""What Snakemake's planning of a run costs: every snakemake command, and on a cluster every job,
reads the workflow and lists each shard's jobs before it runs anything, in time and memory that
grow with the shards (bench/dag.py). `eaglenest plan` states it for the run's shard count."""

from __future__ import annotations

import math
from dataclasses import dataclass

from eaglenest.settings.prompts import MAX_SHARDS

# bench/dag.py at 1,000 and 10,000 shards (bench/RESULTS.md, "DAG", Dec 8 2026): `snakemake -n
# -q` of the demo's workflow at shard_size 1 (3 jobs a shard and the run's own), on this
# project's 2-core machine while it was shared: CPU seconds (its wall time drifts with the load)
# and the process's peak RSS. Linear in shards between and past them (the bench's fit: 1.0).
MEASURED_SHARDS = (1_000, 10_000)
MEASURED_CPU_S = (11.4, 89.2)
MEASURED_PEAK_MIB = (242.4, 948.7)
# Past either, `eaglenest plan` warns: a command (each cluster job too) plans for about a minute
# or more, or needs more than 2 GB of the login node.
WARN_S = 60.0
WARN_MIB = 2e9 / 2**20


@dataclass(frozen=True)
class PlanningCost:
    shards: int
    cpu_s: float
    peak_mib: float


def _through_measured(values: tuple[float, float], shards: float) -> float:
    (low, high), (y_low, y_high) = MEASURED_SHARDS, values
    return y_low + (y_high - y_low) * (shards - low) / (high - low)


def planning_cost(shards: int) -> PlanningCost:
    """Estimated CPU seconds and peak memory of one snakemake command over `shards` shards."""
    return PlanningCost(
        shards=shards,
        cpu_s=_through_measured(MEASURED_CPU_S, shards),
        peak_mib=_through_measured(MEASURED_PEAK_MIB, shards),
    )


def _shards_at(values: tuple[float, float], limit: float) -> int:
    (low, high), (y_low, y_high) = MEASURED_SHARDS, values
    return math.floor(low + (limit - y_low) * (high - low) / (y_high - y_low))


def planning_bound() -> int:
    """The most shards a command plans within WARN_S and WARN_MIB, by the measured figures."""
    return min(_shards_at(MEASURED_CPU_S, WARN_S), _shards_at(MEASURED_PEAK_MIB, WARN_MIB))


def planning_notes(shards: int) -> list[str]:
    """`eaglenest plan`'s lines on the planning: its cost, and a warning past the bound."""
    cost = planning_cost(shards)
    measured = ", ".join(
        f"{cpu_s:g} s and {mib:,.0f} MiB at {shards_measured:,} shards"
        for shards_measured, cpu_s, mib in zip(
            MEASURED_SHARDS, MEASURED_CPU_S, MEASURED_PEAK_MIB, strict=True
        )
    )
    notes = [
        (
            f"Snakemake's planning: ~{cost.cpu_s:,.0f} CPU-s and ~{cost.peak_mib:,.0f} MiB per "
            f"snakemake command (and per cluster job, which reads the workflow again) for "
            f"{shards:,} shards (bench/dag.py on 2 cores: {measured})"
        )
    ]
    if cost.cpu_s > WARN_S or cost.peak_mib > WARN_MIB:
        notes.append(
            f"WARNING: {shards:,} shards are past what a command plans within about a minute "
            f"and 2 GB (~{planning_bound():,} shards; the run's limit, {MAX_SHARDS:,}, is what "
            "memory allows): raise prompts.shard_size"
        )
    return notes
