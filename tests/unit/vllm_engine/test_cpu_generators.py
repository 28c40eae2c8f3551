"""The CPU build's wind-back of a seeded generator after a partial prefill (cpu_generators.py):
a real CPU generator refuses offsets, as vLLM's _bookkeeping_sync meets it; through the fix's
view the wind-back is a no-op that leaves the generator's draws as they were. The engine-level
check (seeded sampling over chunked prefills, the long demo's depth cuts in a real vLLM) is
tests/engine/test_long_reasoning_demo.py."""

from __future__ import annotations

import pytest
import torch

from eaglenest.vllm_engine.cpu_generators import _CpuGenerators


def test_a_cpu_generator_refuses_offsets_and_the_fix_winds_nothing_back():
    generator = torch.Generator(device="cpu").manual_seed(3)
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        generator.set_offset(generator.get_offset() - 4)  # what vLLM 0.32 does

    generators = _CpuGenerators({0: generator})
    twin = torch.Generator(device="cpu").manual_seed(3)
    torch.rand(4, generator=generator)  # the discarded sample
    torch.rand(4, generator=twin)
    seen = generators.get(0)
    seen.set_offset(seen.get_offset() - 4)  # _bookkeeping_sync's wind-back, through the fix
    assert torch.equal(torch.rand(8, generator=generator), torch.rand(8, generator=twin))
    assert generators.get(1) is None  # an unseeded request has no generator
