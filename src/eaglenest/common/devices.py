"""The device rule, written once: `auto` is CUDA when there is one, else the CPU."""

from __future__ import annotations

import torch


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
