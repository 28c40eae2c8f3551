"""The two test lanes. `make test` runs every test; `make check`, the quick lane of development,
only those that start no Snakemake and no real vLLM and are not marked `slow` (CHECK_LANE).

Nobody marks a test `snakemake` or `vllm` by hand: `assign_lanes` (called from tests/conftest.py)
reads what the test's code reaches, its function and fixtures and, transitively, every function of
tests/ they name. Code that starts a process (names `subprocess` or one of its functions) and holds
the string "snakemake" (`python -m snakemake ...`, as support.workflow's runner does) runs
Snakemake; code that names support.vllm's venv (or its `require_vllm_venv` gate) runs vLLM."""

from __future__ import annotations

import inspect
import subprocess
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from support.vllm import VLLM_PYTHON, VLLM_STAMP, VLLM_VENV, require_vllm_venv

CHECK_LANE = "not snakemake and not vllm and not slow"
TESTS_DIR = Path(__file__).resolve().parents[1]
SNAKEMAKE = "snakemake"  # the module `python -m` runs, a string constant of the code that starts it
VLLM_OBJECTS = (VLLM_VENV, VLLM_STAMP, VLLM_PYTHON, require_vllm_venv)


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


def assign_lanes(items: list[pytest.Item], roots: tuple[Path, ...] = (TESTS_DIR,)) -> None:
    """Marks each test that starts Snakemake `snakemake` and each that starts vLLM `vllm`."""
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        strings, objects = reached([item.function, *_fixture_functions(item)], roots)
        if SNAKEMAKE in strings and any(_starts_processes(o) for o in objects):
            item.add_marker(pytest.mark.snakemake)
        if any(o is v for o in objects for v in VLLM_OBJECTS):
            item.add_marker(pytest.mark.vllm)
