"""The suite on several pytest-xdist workers (`make test` and `make check` run three): what a
worker may use of the machine, how the tests are handed out, and what the workers build once
between them.

- Cores: a worker's share (`CORES`, at least one), given to every process a test starts
  (Snakemake's `--cores`, torch, the engines' OpenMP pools through eaglenest.common.threads), so
  that no worker's job asks for the machine (on 2 cores, two 2-thread torch jobs slow each other
  down many times over). On 2 cores three one-thread workers: much of the suite waits (engine
  starts, servers, Snakemake's planning), and the third keeps the cores busy meanwhile.
- Built once: a read-only build many tests need (the demo target, `finished_run`, the offline
  vLLM capture, the plain vLLM decode, the DeepSeek-V3 target and its Kimi-K2.5 run) is made by
  the first worker that asks, under a file lock, in the session's shared temp dir; the others
  wait and reuse it (`built_once`). Tests only read it: one that changes files works in a copy.
  So the modules that share a run need not share a worker: once the run is built, they run side
  by side. The demo target is also kept between sessions (`built_once(..., key=...)`, under
  .cache/tests/, keyed by its settings and the code that builds it): `make check` after an edit
  elsewhere skips its build; a clean clone (CI) builds it.
- Scopes: a module's tests go to one worker (`ModuleScheduling`), so a module-scoped fixture (a
  capture server, a run of the module's own) is built once; a worker gets its next module when
  its last test is all it has left, not queued behind a long build while others idle.
- Order: the modules at the end of the longest chains of builds first (`LONGEST_FIRST`, from the
  suite's CPU profile: tests/support/cpu_log.py), then the other engine tests, the workflow
  tests, the rest, so that no worker starts a long one as the others run out of work
  (`order_for_workers`).
Without xdist every test runs in one process, with every core, in that order.

(xdist's own `--dist loadgroup` marks a group in the test's id, which pytest 9.2 no longer lets
it change: every test went to any worker.)"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1 ... under xdist; None without it
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# The tests were sized for two cores; a worker gets its share of the machine, one to two.
CORES = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
TESTS_DIR = Path(__file__).resolve().parents[1]

# Handed out first, in this order (relative to tests/): each is the last link of a chain of
# builds (target -> run -> engine) that takes minutes, so they start while the short tests fill
# the gaps. The DeepSeek-V3 target and its Kimi-K2.5 run, the long-reasoning run, the small
# demo's target, run and offline capture, then what waits on those.
LONGEST_FIRST = (
    "engine/test_kimi_k25_layout.py",
    "engine/test_long_reasoning_demo.py",
    "engine/test_capture_pool.py",
    "engine/test_deepseek_v3_in_vllm.py",
    "engine/test_training_from_capture_servers.py",
    "engine/test_vllm_capture_server.py",
    "engine/test_eagle3_variants_in_vllm.py",
    "engine/test_drafter_families_in_vllm.py",
    "engine/test_windowed_drafter.py",
    "engine/test_vllm_acceptance.py",
    "engine/test_vllm_cpu_workarounds.py",
)
# After them, by folder: the engine lane's tests take longest, then the workflow lane's.
FOLDER_ORDER = ("engine", "workflow")


def module_of(nodeid: str) -> str:
    """'tests/engine/test_x.py::test_y[a]' -> 'engine/test_x.py'."""
    return nodeid.split("::", 1)[0].removeprefix(f"{TESTS_DIR.name}/")


def order_for_workers(items: list[pytest.Item]) -> None:
    """`items` in the order to hand out: LONGEST_FIRST's modules in its order, the engine's,
    the workflow's, the rest; collection order within each."""

    def rank(item: pytest.Item) -> int:
        module = module_of(item.nodeid)
        if module in LONGEST_FIRST:
            return LONGEST_FIRST.index(module)
        folder = module.split("/", 1)[0]
        later = FOLDER_ORDER.index(folder) if folder in FOLDER_ORDER else len(FOLDER_ORDER)
        return len(LONGEST_FIRST) + later

    items.sort(key=rank)  # stable


class ModuleScheduling(LoadScopeScheduling):
    """xdist's load balancing by scope, a scope being a test module, handed out in collection
    order (which `order_for_workers` set)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return module_of(nodeid)

    def _reschedule(self, node) -> None:
        """The next module once the worker's last test is all it has left (xdist's own waits
        for two: a module whose second-to-last test builds a run for minutes, as the Kimi-K2.5
        run's, held the next module behind it while other workers ran out of work). A worker
        runs a test only once it knows the next (pytest's `nextitem`), so one must be left."""
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)


def use_worker_cores() -> None:
    """This worker, and every process it starts, uses `CORES` threads (nothing without xdist)."""
    if WORKER is None:
        return
    from eaglenest.common.threads import use_threads

    use_threads(CORES)


CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache" / "tests"


def built_once(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    build: Callable[[Path], None],
    key: str | None = None,
) -> Path:
    """`build(path)` run once per session for every worker, the path under the session's temp
    root (shared by the workers); a worker that finds it built, or being built, waits and reuses
    it. With a `key` (a hash of everything the build depends on), once for every session, under
    CACHE_DIR. The result must be read-only for the tests."""
    if key is not None:
        root = CACHE_DIR / key
        root.mkdir(parents=True, exist_ok=True)
    else:
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


def built_facts(out: Path) -> dict[str, Any]:
    """What a build wrote of itself beside its files (`write_facts`): timings, counts, config."""
    return json.loads((out / "facts.json").read_text())


def write_facts(out: Path, facts: dict[str, Any]) -> None:
    (out / "facts.json").write_text(json.dumps(facts, default=str))
