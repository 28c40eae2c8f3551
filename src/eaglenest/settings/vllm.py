"""Settings of vLLM where the pipeline runs it itself (`hidden.backend: vllm`, `evaluate.engine:
vllm`): the `vllm` section, in two objects. `VllmEngine` is what shapes the numbers vLLM returns
(weights' quantization, engine arguments): part of the stages' settings, so a change reruns them.
`VllmRuntime` is where and how big it runs (the interpreter, tensor parallelism, memory, batch):
passed untracked, so moving to another node or another venv reruns nothing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings


@dataclass(frozen=True)
class VllmEngine(Settings):
    quantization: str | None
    engine_args: dict[str, Any]
    cpu_workarounds: bool  # eaglenest.vllm_engine.cpu

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VllmEngine:
        section = config["vllm"]
        return cls(**{k: section[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class VllmRuntime(Settings):
    python: str
    tensor_parallel_size: int
    max_model_len: int | None
    gpu_memory_utilization: float | None
    cpu_kvcache_space_gb: float
    requests_per_batch: int
    # The capture server (`eaglenest serve-capture`) shard jobs send their samples to; None: each
    # job starts an engine of its own. Where the engine runs, not what it computes: the server's
    # served name says what it computes (capture_client.served_name).
    capture_url: str | None
    slots_dir: str | None  # generation.slots_dir: the capture server's cap is held there too

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VllmRuntime:
        section = config["vllm"]
        values = {k: section[k] for k in cls.__dataclass_fields__ if k != "slots_dir"}
        return cls(**values, slots_dir=config["generation"]["slots_dir"])
