"""A fix of vLLM 0.32's CPU build for sampled speculative decoding, applied in the engine's own
process before the engine starts (vllm_engine/decode.py).

Without Triton, the CPU platform swaps the rejection sampler's Triton kernels for C++ stand-ins
(platforms/cpu.py register_triton_kernel_overrides, read when the worker starts). The stand-in
of `expand_kernel` (utils/cpu_triton_utils.py `_expand_kernel_impl`) casts its output to int64
and writes there: for a float output that cast is a copy, so the output is never written. That
output is the per-token temperature of sampled verification (rejection_sampler.py
apply_sampling_constraints, from `new_empty`): the target's logits are divided by whatever the
memory held. Measured here (EAGLE-3, temperature 0.7, one prompt, one seed, twice): the target's
probability of the second draft NaN in every round logged, and the two decodings apart from
their second round. Greedy decoding never reads it. `expand` writes the output in its own dtype,
as the Triton kernel does, and `fix_cpu_expand_kernel` puts it in the stand-in's place:
decode.py calls it before each engine starts, and at its import in an engine core vLLM spawns
(which re-imports the main module as `__mp_main__`). With it, the same prompts and seeds sampled
the same tokens and rounds twice in one engine, in a second engine, and with the engine core
spawned.
"""

from __future__ import annotations

import torch


def expand(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # the Triton kernel's keyword, unused
) -> None:
    """expand_kernel's result: request i's value (replace_from read as replace_to) over its
    tokens, cu_num_tokens[i - 1] up to cu_num_tokens[i], written into `output` in place."""
    values = torch.where(
        input_val == replace_from, torch.full_like(input_val, replace_to), input_val
    )
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    output[: int(ends[-1]) if len(ends) else 0] = torch.repeat_interleave(values, counts).to(
        output.dtype
    )


def fix_cpu_expand_kernel() -> None:
    """`expand` in place of the CPU build's stand-in; nothing where vLLM has none (GPU builds
    keep their Triton kernel: the stand-ins are registered only on a CPU without Triton)."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return
    if hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        cpu_triton_utils._expand_kernel_impl = expand
