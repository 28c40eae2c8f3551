"""`eaglenest plan` states what Snakemake's planning costs a command for the run's shards, from
bench/dag.py's figures at 1,000 and 10,000 shards (between and past them, linearly), and warns
past about a minute or 2 GB a command, naming prompts.shard_size."""

from __future__ import annotations

import re

import pytest

from eaglenest.cli import main
from eaglenest.common.config import REPO_ROOT
from eaglenest.run.planning_cost import (
    MEASURED_CPU_S,
    MEASURED_PEAK_MIB,
    MEASURED_SHARDS,
    WARN_MIB,
    WARN_S,
    planning_bound,
    planning_cost,
)

DEMO = str(REPO_ROOT / "config" / "config.yaml")


def planned(capsys, samples: int, shard_size: int) -> str:
    args = ["--samples", str(samples), "--set", f"prompts.shard_size={shard_size}"]
    assert main(["plan", "--configfile", DEMO, *args]) == 0
    return capsys.readouterr().out


def stated(out: str) -> tuple[int, int, int]:
    line = next(line for line in out.splitlines() if "Snakemake's planning" in line)
    cpu_s, mib, shards = re.search(
        r"~([\d,]+) CPU-s and ~([\d,]+) MiB .* for ([\d,]+) shards", line
    ).groups()
    return tuple(int(x.replace(",", "")) for x in (cpu_s, mib, shards))


def test_the_measured_sizes_are_stated_as_measured(capsys):
    for shards, cpu_s, mib in zip(MEASURED_SHARDS, MEASURED_CPU_S, MEASURED_PEAK_MIB, strict=True):
        assert stated(planned(capsys, shards * 100, 100)) == (round(cpu_s), round(mib), shards)


def test_between_and_past_the_measures_it_is_linear():
    low, high = (planning_cost(n) for n in MEASURED_SHARDS)
    middle = planning_cost(sum(MEASURED_SHARDS) // 2)
    assert middle.cpu_s == pytest.approx((low.cpu_s + high.cpu_s) / 2)
    assert middle.peak_mib == pytest.approx((low.peak_mib + high.peak_mib) / 2)
    far = planning_cost(100_000)  # the run's limit: ~14 min and ~8 GB a command
    assert 800 < far.cpu_s < 900 and 7_500 < far.peak_mib < 8_500
    assert planning_cost(4).cpu_s > 0  # the demo: the start-up, a few seconds


def test_past_a_minute_or_2_gb_the_plan_warns_naming_the_key(capsys):
    bound = planning_bound()
    at_bound = planning_cost(bound)
    assert at_bound.cpu_s <= WARN_S and at_bound.peak_mib <= WARN_MIB
    past = planning_cost(bound + 1)
    assert past.cpu_s > WARN_S or past.peak_mib > WARN_MIB
    assert "WARNING" not in planned(capsys, bound, 1)
    out = planned(capsys, bound + 1, 1)
    warning = next(line for line in out.splitlines() if "WARNING" in line)
    assert f"{bound + 1:,} shards are past what a command plans within about a minute" in warning
    assert warning.endswith("raise prompts.shard_size")
    assert stated(out)[2] == bound + 1
