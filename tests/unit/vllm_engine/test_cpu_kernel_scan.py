"""The kernel scan of vLLM's CPU build made tolerant (cpu_kernel_scan.py): an attribute whose
`__dict__` is no mapping, as llvmlite's `_lib_fn_wrapper` (vLLM's Kimi-K2.5 processor loads it),
is hidden from the scan while it runs and put back; every other reference is rebound as before.
The scan here reads modules as vLLM 0.32's `_rebind_kernels` does (`vars(value).get("kernel")`);
the real one runs in the engine lane: the Kimi-K2.5 layout run's engines
(tests/engine/test_kimi_k25_layout.py) keep their engine core in their process."""

from __future__ import annotations

import sys
import types

import pytest

from eaglenest.vllm_engine.cpu_kernel_scan import tolerant, unscannable


class LibFunctionWrapper:
    """As llvmlite.binding.ffi's `_lib_fn_wrapper`: any dunder it lacks is one more wrapper,
    so its `__dict__` is no mapping."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            return LibFunctionWrapper(attr)
        raise AttributeError(f"'_lib_fn_wrapper' object has no attribute {attr!r}")


class Owner:
    """A JIT warmup owner: holds a kernel as an instance attribute."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel


def rebind_as_vllm_does(overrides) -> None:
    """What vLLM 0.32's scan reads of every module attribute (only the kernels compared, by
    identity: the test's own module is scanned too)."""
    [(original, wrapper)] = overrides
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                setattr(module, attr, wrapper)
            elif hasattr(value, "__dict__") and vars(value).get("kernel") is original:
                value.kernel = wrapper


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, types.ModuleType]:
    ffi = types.ModuleType("fake_llvmlite_ffi")
    ffi.lib = LibFunctionWrapper("lib")
    holder = types.ModuleType("fake_kernel_holder")
    holder.kernel = types.SimpleNamespace(name="kernel")
    holder.owner = Owner(holder.kernel)
    monkeypatch.setitem(sys.modules, ffi.__name__, ffi)
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    return ffi, holder


def test_the_scan_fails_on_a_dict_that_is_no_mapping_and_the_tolerant_one_rebinds(modules):
    ffi, holder = modules
    kernel, stand_in = holder.kernel, types.SimpleNamespace(name="stand-in")
    with pytest.MonkeyPatch.context() as patch, pytest.raises(AttributeError, match="'get'"):
        patch.setattr(sys, "modules", {ffi.__name__: ffi, holder.__name__: holder})
        rebind_as_vllm_does([(kernel, stand_in)])  # untouched: it ends on llvmlite's wrapper
    assert holder.kernel is kernel  # the scan ended before reaching it
    assert (ffi, "lib") in unscannable(sys.modules)
    assert (holder, "owner") not in unscannable(sys.modules)

    tolerant(rebind_as_vllm_does)([(kernel, stand_in)])
    assert holder.kernel is stand_in and holder.owner.kernel is stand_in
    assert isinstance(ffi.lib, LibFunctionWrapper) and ffi.lib.name == "lib"  # put back


def test_the_attributes_come_back_when_the_scan_fails(modules):
    ffi, _ = modules

    def failing(overrides) -> None:
        assert not hasattr(ffi, "lib")  # hidden while the scan runs
        raise RuntimeError("the scan failed")

    with pytest.raises(RuntimeError, match="the scan failed"):
        tolerant(failing)([])
    assert isinstance(ffi.lib, LibFunctionWrapper)
