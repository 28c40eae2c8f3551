"""The test lanes, a folder each. `make test` runs every test; `make check`, the quick lane of
development, only those marked neither `snakemake` nor `vllm` nor `slow` (CHECK_LANE).

A lane's folder marks its tests in its conftest (`mark_folder`): tests/workflow/ `snakemake`
(real Snakemake in a temp dir), tests/engine/ `vllm` (a real vLLM from .venv-vllm). Nothing is
inferred at collection. tests/house/test_lanes.py keeps the lanes honest with `lane_violations`:
no test outside those folders may reach Snakemake or vLLM, read from what its code reaches (its
function and fixtures and, transitively, every function of tests/ they name). Code that starts a
process (names `subprocess` or one of its functions) and holds the string "snakemake"
(`python -m snakemake ...`, as support.workflow's runner does) runs Snakemake; code that names
support.vllm's venv (or its `require_vllm_venv` gate) runs vLLM."""

from __future__ import annotations

import inspect
import subprocess
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import pytest

from support.vllm import VLLM_PYTHON, VLLM_STAMP, VLLM_VENV, require_vllm_venv

CHECK_LANE = "not snakemake and not vllm and not slow"
TESTS_DIR = Path(__file__).resolve().parents[1]
SNAKEMAKE = "snakemake"  # the module `python -m` runs, a string constant of the code that starts it
VLLM = "vllm"
# Where a test that reaches each lane's component may live: a workflow test starts Snakemake; an
# engine test may too (the pipeline against a real vLLM), and is the only one to start vLLM.
LANE_FOLDERS = {
    SNAKEMAKE: (TESTS_DIR / "workflow", TESTS_DIR / "engine"),
    VLLM: (TESTS_DIR / "engine",),
}
VLLM_OBJECTS = (VLLM_VENV, VLLM_STAMP, VLLM_PYTHON, require_vllm_venv)
# Every test the session collected, before `-m`/`-k` deselect any (stored by tests/conftest.py).
COLLECTED = pytest.StashKey[list]()


def mark_folder(items: list[pytest.Item], folder: Path, *marks: pytest.MarkDecorator) -> None:
    """Gives every test under `folder` these marks (a conftest's hook sees every test of the
    session, so it keeps to its own folder)."""
    for item in items:
        if item.path.is_relative_to(folder):
            for mark in marks:
                item.add_marker(mark)


def _defined_under(function: object, roots: tuple[Path, ...]) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and any(
        Path(code.co_filename).resolve().is_relative_to(r) for r in roots
    )


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    """The code and the code of what it defines (inner functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def reached(
    functions: Iterable[Callable], roots: tuple[Path, ...] = (TESTS_DIR,)
) -> tuple[set[str], list[object]]:
    """The string constants and the global objects named by these functions' code and by every
    function defined under `roots` (tests/) it names, transitively."""
    strings: set[str] = set()
    objects: list[object] = []
    todo = [f for f in map(inspect.unwrap, functions) if _defined_under(f, roots)]
    seen: set[types.CodeType] = set()
    while todo:
        function = todo.pop()
        if function.__code__ in seen:
            continue
        seen.add(function.__code__)
        for code in _code_objects(function.__code__):
            strings.update(c for c in code.co_consts if isinstance(c, str))
            for name in code.co_names:
                if name not in function.__globals__:
                    continue  # an attribute's name, or a builtin
                target = function.__globals__[name]
                objects.append(target)
                if inspect.isfunction(target) and _defined_under(target, roots):
                    todo.append(target)
    return strings, objects


def _starts_processes(target: object) -> bool:
    return target is subprocess or getattr(target, "__module__", None) == "subprocess"


def _fixture_functions(item: pytest.Function) -> list[Callable]:
    return [
        definition.func
        for definitions in item._fixtureinfo.name2fixturedefs.values()
        for definition in definitions
    ]


def lanes_reached(item: pytest.Function, roots: tuple[Path, ...] = (TESTS_DIR,)) -> set[str]:
    """ "snakemake" when the test's code starts Snakemake, "vllm" when it runs the real vLLM."""
    strings, objects = reached([item.function, *_fixture_functions(item)], roots)
    lanes = set()
    if SNAKEMAKE in strings and any(_starts_processes(o) for o in objects):
        lanes.add(SNAKEMAKE)
    if any(o is v for o in objects for v in VLLM_OBJECTS):
        lanes.add(VLLM)
    return lanes


def lane_violations(
    items: Iterable[pytest.Item],
    roots: tuple[Path, ...] = (TESTS_DIR,),
    folders: Mapping[str, tuple[Path, ...]] = LANE_FOLDERS,
) -> list[tuple[str, str]]:
    """(lane, node id) of each test that reaches a lane's component from outside its folders."""
    return [
        (lane, item.nodeid)
        for item in items
        if isinstance(item, pytest.Function)
        for lane in sorted(lanes_reached(item, roots))
        if not any(item.path.is_relative_to(folder) for folder in folders[lane])
    ]
