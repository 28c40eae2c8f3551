"""The target model itself: loading it (transformers, on the chosen device) and the facts of its
architecture that the stages share (decoder layers, vLLM's default aux layer ids)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eaglenest.common.devices import resolve_device
from eaglenest.common.io import sha256_file
from eaglenest.target.files import resolve_target_dir

_MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_aux_layer_ids(num_hidden_layers: int) -> tuple[int, int, int]:
    """vLLM's default `eagle_aux_hidden_state_layer_ids`."""
    n = num_hidden_layers
    return (2, n // 2, n - 3)


def target_config_hash(target_path: str | Path) -> str:
    return sha256_file(resolve_target_dir(target_path) / "config.json")


def resolve_model_dtype(model_dtype: str, device: str) -> torch.dtype:
    if model_dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return _MODEL_DTYPES[model_dtype]


def load_target(
    path: str | Path,
    device: str = "auto",
    model_dtype: str = "auto",
    trust_remote_code: bool = False,
):
    """The target in eval mode, on `device` (device_map=auto over several GPUs)."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    dtype = resolve_model_dtype(model_dtype, device)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    several_gpus = device == "cuda" and torch.cuda.device_count() > 1
    if several_gpus:
        kwargs["device_map"] = "auto"
    model = AutoModelForCausalLM.from_pretrained(str(resolve_target_dir(path)), **kwargs)
    if not several_gpus:
        model.to(device)
    model.eval()
    return model


def decoder_layers(model) -> Any:
    return model.model.layers
