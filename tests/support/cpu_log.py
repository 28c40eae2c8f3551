"""Where the suite's time goes: with EAGLENEST_TEST_CPU_LOG=<dir> set, every test phase (setup,
call, teardown) appends one JSON line to <dir>/<worker>.jsonl: its wall seconds, the CPU seconds
of the worker itself and of the processes it reaped meanwhile (Snakemake, its jobs, engines a
test stopped), and when it started. Off by default. `python tests/support/cpu_log.py <dir>`
prints the CPU seconds per lane and per module, the largest first."""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOG_DIR = os.environ.get("EAGLENEST_TEST_CPU_LOG")


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@contextmanager
def cpu_logged(nodeid: str, phase: str) -> Iterator[None]:
    if not LOG_DIR:
        yield
        return
    started, wall = time.time(), time.monotonic()
    own, children = _cpu()
    try:
        yield
    finally:
        own_after, children_after = _cpu()
        line = {
            "test": nodeid,
            "phase": phase,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "start": started,
            "wall_s": round(time.monotonic() - wall, 2),
            "cpu_s": round(own_after - own, 2),
            "children_cpu_s": round(children_after - children, 2),
        }
        Path(LOG_DIR).mkdir(parents=True, exist_ok=True)
        path = Path(LOG_DIR) / f"{line['worker']}.jsonl"
        with path.open("a") as out:
            out.write(json.dumps(line) + "\n")


def cpu_by_module(log_dir: Path) -> dict[str, float]:
    """CPU seconds (the worker's and its processes') per test module, over every phase."""
    totals: dict[str, float] = {}
    for path in sorted(log_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            module = row["test"].split("::", 1)[0]
            totals[module] = totals.get(module, 0.0) + row["cpu_s"] + row["children_cpu_s"]
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


if __name__ == "__main__":
    import sys

    modules = cpu_by_module(Path(sys.argv[1]))
    lanes: dict[str, float] = {}
    for module, seconds in modules.items():
        lane = module.split("/")[1] if "/" in module else module
        lanes[lane] = lanes.get(lane, 0.0) + seconds
    print(
        f"{sum(modules.values()):.0f} CPU-s in all; by lane:",
        {k: round(v) for k, v in lanes.items()},
    )
    for module, seconds in modules.items():
        print(f"{seconds:8.0f}  {module}")
