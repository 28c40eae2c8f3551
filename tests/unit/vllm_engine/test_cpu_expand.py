"""The fix of vLLM 0.32's CPU stand-in for the rejection sampler's expand_kernel
(vllm_engine/cpu_expand.py): each request's value over its tokens, written into the output in the
output's own dtype (the stand-in wrote an int64 copy, leaving a float output, the per-token
temperature of sampled verification, unwritten). The engine's sampled decoding that needs it:
tests/engine/test_vllm_acceptance.py."""

from __future__ import annotations

import torch

from eaglenest.vllm_engine.cpu_expand import expand


def test_each_requests_value_fills_its_tokens_in_the_outputs_own_dtype():
    # Three requests with 2, 3 and 0 draft tokens: temperatures 0.7, greedy (0 read as 1), 1.3.
    temperature = torch.tensor([0.7, 0.0, 1.3])
    cu_num_tokens = torch.tensor([2, 5, 5], dtype=torch.int32)
    output = torch.full((6,), float("nan"))  # as uninitialised memory might hold
    expand(output, temperature, cu_num_tokens, replace_from=0, replace_to=1)
    assert torch.allclose(output[:5], torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0]))
    assert output[5].isnan()  # past the last request's tokens: untouched, as the kernel leaves it
    top_k = torch.tensor([5, 0], dtype=torch.int64)
    ids = torch.zeros(4, dtype=torch.int64)
    expand(ids, top_k, torch.tensor([1, 4]), replace_from=0, replace_to=0)
    assert ids.tolist() == [5, 0, 0, 0]
