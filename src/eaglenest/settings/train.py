"""Settings of the train stage: the `train` section, less which shards are held out (the rule's
inputs say that)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings


@dataclass(frozen=True)
class TrainSettings(Settings):
    epochs: int
    max_steps: int | None
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    max_batch_tokens: int
    ttt_steps: int
    step_weight: float
    checkpoint_every: int
    log_every: int
    eval_every: int  # 0: held-out loss and accuracy at the end only
    seed: int
    gpus: int  # above 1: one process per GPU under torchrun
    device: str  # "auto" (eaglenest.common.devices.resolve_device) or a torch device
    precision: str  # auto = bf16 autocast on CUDA, float32 on CPU
    export_dtype: str
    activation_checkpointing: bool  # recompute the drafter layer in backward (long samples)
    drafter: dict[str, Any]  # overrides of the drafter's sizes

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TrainSettings:
        return cls(**{k: config["train"][k] for k in cls.__dataclass_fields__})
