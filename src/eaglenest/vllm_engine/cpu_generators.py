"""A fix of vLLM 0.32's CPU build for seeded sampling over chunked prefills, applied in the
engine's own process before the engine starts (vllm_engine/decode.py, beside cpu_expand.py).

A prompt longer than the step's token budget (max_num_batched_tokens) is prefilled in chunks; the
token sampled after a partial chunk is discarded, and GPUModelRunner._bookkeeping_sync winds a
seeded request's generator back over it (`gen.set_offset(gen.get_offset() - 4)`, Philox offsets).
A CPU generator (Mersenne Twister) has no offset: "RuntimeError: CPU Generator does not use
offset" ends the engine. Seen here: the long-reasoning study's evaluation, its prompts cut at
depths up to 8,192 decoded sampled with per-prompt seeds; greedy decoding has no generators.
On the CPU the fix leaves the generator where the discarded sample left it: a request's draws
still follow from its seed and the schedule, which the same prompts, order and engine repeat,
so sampled figures stay reproducible; they are not those a GPU, which winds back, would draw.
"""

from __future__ import annotations

from typing import Any


class _Unwound:
    """A CPU generator as _bookkeeping_sync's wind-back sees it: no offset, nothing to wind."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        return None


class _CpuGenerators(dict):
    def get(self, key: Any, default: Any = None) -> Any:
        generator = super().get(key, default)
        return _Unwound(generator) if generator is not None else None


def fix_cpu_generator_offsets() -> None:
    """_bookkeeping_sync sees CPU generators without offsets; nothing on other devices, nor
    where vLLM has no such runner. Idempotent."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return
    original = GPUModelRunner._bookkeeping_sync
    if getattr(original, "eaglenest_fixed", False):
        return

    def bookkeeping_sync(self, *args: Any, **kwargs: Any) -> Any:
        batch = self.input_batch
        if self.device.type != "cpu" or not batch.generators:
            return original(self, *args, **kwargs)
        generators = batch.generators
        batch.generators = _CpuGenerators(generators)
        try:
            return original(self, *args, **kwargs)
        finally:
            batch.generators = generators

    bookkeeping_sync.eaglenest_fixed = True  # type: ignore[attr-defined]
    GPUModelRunner._bookkeeping_sync = bookkeeping_sync
