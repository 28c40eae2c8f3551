"""The suite on several pytest-xdist workers (`make test` and `make check` run three): what a
worker may use of the machine, which tests run on one worker because they share a run, in what
order the work is handed out, and what the workers build once between them.

- Cores: a worker's share (`CORES`, at least one), given to every process a test starts
  (Snakemake's `--cores`, torch, the engines' OpenMP pools through eaglenest.common.threads), so
  that no worker's job asks for the machine (on 2 cores, two 2-thread torch jobs slow each other
  down many times over). On 2 cores three one-thread workers: much of the suite waits (engine
  starts, servers, Snakemake's planning), and the third keeps the cores busy meanwhile.
- Groups: the test modules that share a session fixture which is a run of its own (the
  DeepSeek-V3 target and its Kimi-K2.5 run, the offline vLLM capture, the plain vLLM decode) form
  one group each (`SHARED_RUN_GROUPS`), which one worker runs whole (`SharedRunScheduling`): the
  run is built once. A group is named by its modules, as the controller sees only test ids;
  tests/house/test_workers.py holds every test that asks for a group's fixture inside it.
- Order: the groups first, the longest (the DeepSeek-V3 one) first of all, then the engine
  tests, the workflow tests, the rest, so that no worker starts a long one as the other runs out
  of work (`order_for_workers`).
- Built once: a read-only build many tests need (the demo target, `finished_run`) is made by the
  first worker that asks, under a file lock, in the session's shared temp dir; the others wait
  and reuse it. Tests only read it: one that runs Snakemake in it works in its own copy. The demo
  target is also kept between sessions (`built_once(..., key=...)`, under .cache/tests/, keyed by
  its settings and the code that builds it): `make check` after an edit elsewhere skips its two
  minutes; a clean clone (CI) builds it.
Without xdist every test runs in one process, with every core, in that order.

(xdist's own `--dist loadgroup` marks a group in the test's id, which pytest 9.2 no longer lets
it change: every test went to any worker, and each worker built each run.)"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1 ... under xdist; None without it
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# The tests were sized for two cores; a worker gets its share of the machine, one to two.
CORES = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
TESTS_DIR = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class SharedRunGroup:
    name: str
    fixture: str  # the session fixture the group's tests share (or one it depends on)
    modules: tuple[str, ...]  # relative to tests/


# In the order they are handed out: the longest first.
SHARED_RUN_GROUPS = (
    SharedRunGroup("deepseek-v3", "deepseek_target_dir", (
        "engine/test_kimi_k25_layout.py",
        "engine/test_deepseek_v3_in_vllm.py",
        "engine/test_vllm_cpu_workarounds.py",
    )),
    SharedRunGroup("vllm-capture", "vllm_captured_run", (
        "engine/test_vllm_capture_backend.py",
        "engine/test_vllm_capture_server.py",
        "engine/test_capture_pool.py",
        "engine/test_training_from_capture_servers.py",
    )),
    SharedRunGroup("long-reasoning", "long_run", (
        "engine/test_long_reasoning_demo.py",
    )),
    SharedRunGroup("plain-decoding", "plain_decoding", (
        "engine/test_vllm_acceptance.py",
        "engine/test_eagle3_variants_in_vllm.py",
        "engine/test_windowed_drafter.py",
    )),
)  # fmt: skip
# After the groups, by folder: the engine lane's tests take longest, then the workflow lane's.
FOLDER_ORDER = ("engine", "workflow")


def module_of(nodeid: str) -> str:
    """'tests/engine/test_x.py::test_y[a]' -> 'engine/test_x.py'."""
    return nodeid.split("::", 1)[0].removeprefix(f"{TESTS_DIR.name}/")


def group_of(nodeid: str) -> SharedRunGroup | None:
    module = module_of(nodeid)
    return next((group for group in SHARED_RUN_GROUPS if module in group.modules), None)


def misplaced_tests(items: list[pytest.Item]) -> list[str]:
    """Tests that ask for a group's fixture outside the group's modules (a second worker would
    build the run again)."""
    return [
        f"{item.nodeid} uses {group.fixture}: add its module to the {group.name!r} group"
        for item in items
        for group in SHARED_RUN_GROUPS
        if group.fixture in getattr(item, "fixturenames", ()) and group_of(item.nodeid) != group
    ]


def order_for_workers(items: list[pytest.Item]) -> None:
    """`items` in the order to hand out: the groups' tests, the engine's, the workflow's, the
    rest; collection order within each."""

    def rank(item: pytest.Item) -> int:
        group = group_of(item.nodeid)
        if group is not None:
            return SHARED_RUN_GROUPS.index(group)
        folder = module_of(item.nodeid).split("/", 1)[0]
        later = FOLDER_ORDER.index(folder) if folder in FOLDER_ORDER else len(FOLDER_ORDER)
        return len(SHARED_RUN_GROUPS) + later

    items.sort(key=rank)  # stable


class SharedRunScheduling(LoadScopeScheduling):
    """xdist's load balancing by scope, a scope being a shared run's group or a single test,
    handed out in collection order (which `order_for_workers` set)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        group = group_of(nodeid)
        return group.name if group is not None else nodeid


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
