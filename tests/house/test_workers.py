"""The suite's workers (tests/support/workers.py): a shared run is built once for every worker
(a session fixture that runs Snakemake or starts vLLM goes through `built_once`), a module's
tests go to one worker, and the longest chains are handed out first, in their order."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from support.lanes import COLLECTED
from support.workers import LONGEST_FIRST, TESTS_DIR, ModuleScheduling, order_for_workers

CONFTESTS = (TESTS_DIR / "conftest.py", TESTS_DIR / "engine" / "conftest.py")
# What builds a run or starts an engine in a fixture's body.
EXPENSIVE_CALLS = {"snakemake", "decode", "vllm_server", "serve_capture_and_run"}


def whole_suite(request: pytest.FixtureRequest) -> list[pytest.Item] | None:
    """Every test of the suite as this session collected them; None when it collected part of
    them only, after running the calling test in a session of the whole suite."""
    items = request.config.stash.get(COLLECTED, [])
    if set(TESTS_DIR.rglob("test_*.py")) <= {Path(item.path) for item in items}:
        return items
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(TESTS_DIR), "-q", "-p", "no:cacheprovider"]
        + ["-k", request.node.name, "--durations=0", "--durations-min=1000"],
        cwd=TESTS_DIR.parent, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    return None


def session_fixtures(path: Path) -> dict[str, ast.FunctionDef]:
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and any(
            "session" in ast.unparse(decorator) for decorator in node.decorator_list
        ):
            found[node.name] = node
    return found


def called_names(node: ast.AST) -> set[str]:
    return {
        call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
    }


def unshared_builds(paths: tuple[Path, ...]) -> list[str]:
    """Session fixtures that run Snakemake or start vLLM outside `built_once`: each worker that
    asks would build its own."""
    return [
        f"{path.relative_to(TESTS_DIR)}::{name}"
        for path in paths
        for name, node in session_fixtures(path).items()
        if called_names(node) & EXPENSIVE_CALLS and "built_once" not in called_names(node)
    ]


def test_every_shared_run_is_built_once_for_every_worker():
    assert session_fixtures(CONFTESTS[1]), "no session fixture found: the parse is wrong"
    assert unshared_builds(CONFTESTS) == []


def test_a_session_fixture_that_builds_a_run_alone_is_named(tmp_path: Path):
    """Planted: a conftest whose session fixture runs Snakemake itself."""
    planted = TESTS_DIR / "engine" / "conftest_planted_for_a_test.py"
    source = (
        "import pytest\n\n"
        "@pytest.fixture(scope='session')\n"
        "def own_run(tmp_path_factory):\n"
        "    return snakemake(tmp_path_factory.mktemp('x'))\n"
    )
    planted.write_text(source)
    try:
        assert unshared_builds((planted,)) == ["engine/conftest_planted_for_a_test.py::own_run"]
    finally:
        planted.unlink()


def test_a_modules_tests_share_a_scope():
    scope = ModuleScheduling._split_scope
    assert scope(None, "tests/engine/test_x.py::test_a[1]") == "engine/test_x.py"
    assert scope(None, "tests/engine/test_x.py::test_b") == "engine/test_x.py"


def test_the_longest_chains_are_handed_out_first_in_their_order(request: pytest.FixtureRequest):
    missing = [module for module in LONGEST_FIRST if not (TESTS_DIR / module).exists()]
    assert missing == []
    items = whole_suite(request)
    if items is None:
        return
    ordered = list(items)
    order_for_workers(ordered)
    modules = list(dict.fromkeys(item.nodeid.split("::")[0] for item in ordered))
    first = [m.removeprefix(f"{TESTS_DIR.name}/") for m in modules[: len(LONGEST_FIRST)]]
    assert first == list(LONGEST_FIRST)
    # and this session runs its tests in that order
    position = {item.nodeid: index for index, item in enumerate(ordered)}
    ran = [position[item.nodeid] for item in request.session.items]
    assert ran == sorted(ran)


def test_a_worker_gets_its_next_module_when_its_last_test_is_all_it_has_left():
    """Not while a test before its last may still build a run for minutes (the Kimi-K2.5 run's
    test is its module's second of three): the next module would wait behind it."""
    from collections import OrderedDict

    class Node:  # what _reschedule reads of xdist's WorkerController
        shutting_down = False

    scheduler = ModuleScheduling.__new__(ModuleScheduling)
    node = Node()
    scheduler.workqueue = OrderedDict(
        {"engine/test_next.py": {"tests/engine/test_next.py::t": False}}
    )
    given: list[object] = []
    scheduler._assign_work_unit = given.append
    module = {"tests/engine/test_kimi.py::a": True, "tests/engine/test_kimi.py::b": False,
              "tests/engine/test_kimi.py::c": False}  # fmt: skip
    scheduler.assigned_work = {node: {"engine/test_kimi.py": module}}
    scheduler._reschedule(node)
    assert given == []  # b (the run) and c left: c, and the next module, wait behind b
    module["tests/engine/test_kimi.py::b"] = True
    scheduler._reschedule(node)
    assert given == [node]
