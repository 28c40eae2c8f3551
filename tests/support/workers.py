"""The suite on several pytest-xdist workers (`make test` and `make check` run two): what a
worker may use of the machine, which tests run on one worker because they share a run, and what
the workers build once between them.

- Cores: a worker's share (`CORES`), given to every process a test starts (Snakemake's
  `--cores`, torch, the engines' OpenMP pools through eaglenest.common.threads), so that two
  workers never ask for more threads than the machine has (on 2 cores, two 2-thread torch jobs
  slow each other down many times over).
- Groups: the tests that share a session fixture which is a run of its own (the DeepSeek-V3
  target and its Kimi-K2.5 run, the offline vLLM capture, the plain vLLM decode) form one xdist
  group each (`--dist loadgroup`): one worker builds it once and runs them all, in order.
- Built once: a read-only build many tests need (the demo target, `finished_run`) is made by the
  first worker that asks, under a file lock, in the session's shared temp dir; the others wait
  and reuse it. Tests only read it: one that runs Snakemake in it works in its own copy.
Without xdist every test runs in one process, with every core, as before."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1 ... under xdist; None without it
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# The tests were sized for two cores; a worker gets its share of the machine, at most two.
CORES = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
# The session fixture a test shares -> the xdist group of every test that needs it.
SHARED_RUN_GROUPS = {
    "deepseek_target_dir": "deepseek-v3",
    "vllm_captured_run": "vllm-capture",
    "plain_decoding": "plain-decoding",
}


def shared_run_group(item: pytest.Item) -> str | None:
    """The group of the shared run `item` needs (through any of its fixtures), if any."""
    names = getattr(item, "fixturenames", ())
    return next((group for name, group in SHARED_RUN_GROUPS.items() if name in names), None)


def mark_shared_run_groups(items: list[pytest.Item]) -> None:
    for item in items:
        group = shared_run_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def use_worker_cores() -> None:
    """This worker, and every process it starts, uses `CORES` threads (nothing without xdist)."""
    if WORKER is None:
        return
    from eaglenest.common.threads import use_threads

    use_threads(CORES)


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> Path:
    """`build(path)` run once per session for every worker, the path under the session's temp
    root (shared by the workers); a worker that finds it built, or being built, waits and reuses
    it. The result must be read-only for the tests."""
    root = tmp_path_factory.getbasetemp()
    if WORKER is not None:
        root = root.parent  # the workers' temp dirs (popen-gw0 ...) lie side by side in it
    out, done = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            build(out)
            done.touch()
    return out
