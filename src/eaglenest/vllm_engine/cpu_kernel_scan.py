"""A fix of vLLM 0.32's CPU build for an engine core in our engine process, applied there before
each engine starts (process.py `one_shot_llm`, for the evaluation's and the offline capture's).

Without Triton, the CPU platform registers its kernel stand-ins when the worker starts
(platforms/cpu.py register_triton_kernel_overrides), and first points every other reference to
each kernel at its stand-in by scanning every attribute of every module in sys.modules
(triton_utils/dispatcher.py `_rebind_kernels`), reading `vars(value).get("kernel")` of each one
that has a `__dict__`. An object whose `__dict__` is no mapping ends the engine there:
`llvmlite.binding.ffi.lib` ("'_lib_fn_wrapper' object has no attribute 'get'"), loaded (through
numba) by vLLM's own Kimi-K2.5 processor, transformers_utils/processors/kimi_k25.py, with the
model of the Kimi-K2.5 layout. With the engine core in a process of
its own (vLLM's default) that module is not loaded where the scan runs; with the core in ours
(process.one_shot_llm, one import of vLLM and torch fewer per engine) it is.
`fix_cpu_kernel_scan` hides such attributes from the scan while it runs and puts them back: the
scan finds no kernel in them (they hold none) and rebinds every other reference as before. Seen
here: the Kimi-K2.5 demo run's plain, K=3 and K=7 engines in one process, every count and token
of its metrics.json equal to those of the engine cores spawned, 54 -> 28 s of CPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def unscannable(modules: dict[str, Any]) -> list[tuple[Any, str]]:
    """(module, attribute) of every module attribute the scan would fail on: a value with a
    `__dict__` that is not a mapping (no `get`)."""
    found = []
    for module in list(modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            try:
                fails = hasattr(value, "__dict__") and not hasattr(vars(value), "get")
            except TypeError:  # vars() refused: the scan's hasattr said no `__dict__` too
                fails = False
            if fails:
                found.append((module, attr))
    return found


@contextmanager
def hidden(attributes: list[tuple[Any, str]]) -> Iterator[None]:
    """`attributes` removed from their modules for the block, put back after it."""
    saved = [(module, attr, getattr(module, attr)) for module, attr in attributes]
    for module, attr, _ in saved:
        delattr(module, attr)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def tolerant(rebind: Callable[[Any], None]) -> Callable[[Any], None]:
    """`rebind` (vLLM's `_rebind_kernels`) run with the unscannable attributes hidden."""

    def rebind_tolerantly(overrides: Any) -> None:
        with hidden(unscannable(sys.modules)):
            rebind(overrides)

    rebind_tolerantly.tolerant = True  # type: ignore[attr-defined]
    return rebind_tolerantly


def fix_cpu_kernel_scan() -> None:
    """vLLM's kernel scan made tolerant (once); nothing where vLLM has no such scan."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    rebind = getattr(dispatcher, "_rebind_kernels", None)
    if rebind is not None and not getattr(rebind, "tolerant", False):
        dispatcher._rebind_kernels = tolerant(rebind)
