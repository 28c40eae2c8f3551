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
from eaglenest.settings.urls import capture_urls


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
    # The capture servers (`eaglenest serve-capture`, one a node) shard jobs send their samples
    # to: `vllm.capture_urls` and the single `vllm.capture_url`, in that order, each once; empty:
    # each job starts an engine of its own. Where the engines run, not what they compute: each
    # server's served name says what it computes (capture/request.served_name).
    capture_urls: tuple[str, ...]
    # How long a shard job waits for a capture server to answer again when none does.
    capture_wait_s: float
    # The capture pool's other bounds (capture/pool.py): one answer, one state file's lock after
    # it, and the sends of one sample to servers that fail it.
    capture_request_timeout_s: float
    capture_lock_wait_s: float
    capture_moves_max: int
    # The name of the environment variable holding the capture servers' key (never the key: a
    # secret stays out of configs, results and logs); null = the servers take no key.
    capture_key_env: str | None
    slots_dir: str | None  # generation.slots_dir: each capture server's cap is held there too

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VllmRuntime:
        section = config["vllm"]
        skip = ("slots_dir", "capture_urls")
        values = {k: section[k] for k in cls.__dataclass_fields__ if k not in skip}
        return cls(
            **values,
            capture_urls=capture_urls(section),
            slots_dir=config["generation"]["slots_dir"],
        )
