"""What a vLLM capture engine is started with, for the offline engine of a shard job
(vllm_engine/capture.py) and for the run's capture server (capture/server.py, vllm_engine/serve.py) alike, and
the name that server serves under."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.vllm_engine.process import EngineError

if TYPE_CHECKING:
    from eaglenest.settings.hidden_states import HiddenSettings
    from eaglenest.settings.vllm import VllmRuntime


class VllmCaptureError(EngineError):
    """vLLM failed, or returned states that are not those of the tokens sent."""


def capture_engine_request(
    *,
    target_dir: Path,
    layer_ids: list[int],
    settings: HiddenSettings,
    runtime: VllmRuntime,
    work_dir: Path,
    longest: int,
    trust_remote_code: bool,
) -> dict[str, Any]:
    engine = settings.engine
    if runtime.max_model_len is not None and longest + 1 > runtime.max_model_len:
        raise VllmCaptureError(
            f"vllm.max_model_len {runtime.max_model_len}: the longest sample has {longest} tokens "
            "(plus the one token vLLM generates)"
        )
    return {
        "target": str(target_dir),
        "dtype": settings.model_dtype,
        "tensor_parallel_size": runtime.tensor_parallel_size,
        "quantization": engine.quantization if engine else None,
        "engine_args": engine.engine_args if engine else {},
        "cpu_workarounds": engine.cpu_workarounds if engine else True,
        "max_model_len": runtime.max_model_len or longest + 1,
        "gpu_memory_utilization": runtime.gpu_memory_utilization,
        "requests_per_batch": runtime.requests_per_batch,
        "trust_remote_code": trust_remote_code,
        "layer_ids": layer_ids,
        "out_dir": str(work_dir),
    }


def served_name(request: dict[str, Any]) -> str:
    """The model name the capture server serves under: a hash of what shapes its states (target,
    dtype, quantization, engine arguments, CPU fixes, layers). A job checks it before it sends
    anything, so a server started with another config is refused, not used."""
    keys = (
        "target",
        "dtype",
        "quantization",
        "engine_args",
        "cpu_workarounds",
        "layer_ids",
        "trust_remote_code",
    )
    values = {key: request[key] for key in keys}
    if Path(values["target"]).is_dir():  # the same target however the job names its directory
        values["target"] = str(Path(values["target"]).resolve())
    shaping = json.dumps(values, sort_keys=True)
    return "eaglenest-capture-" + hashlib.sha256(shaping.encode()).hexdigest()[:16]
