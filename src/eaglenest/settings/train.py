"""Settings of the train stage: the `train` section, less which shards are held out (the rule's
inputs say that)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings
from eaglenest.settings.target import TargetSettings

# The EAGLE-3 variants (booleans of train.drafter and of the exported config.json), as vLLM's
# model_executor/models/llama_eagle3.py reads them.
DRAFTER_VARIANTS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


@dataclass(frozen=True)
class TrainSettings(Settings):
    epochs: int
    max_steps: int | None
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    adam_betas: tuple[float, float]
    loss: str  # cross_entropy | forward_kl | hard_cross_entropy (stages/train/loss.py, Objective)
    target_outside_vocab: str  # renormalise | ignore (stages/train/loss.py, Objective)
    loss_positions: str  # completion | all (stages/train/loss.py, Objective)
    lm_head_init: str  # random | target | target_frozen
    init_std: float | None  # N(0, init_std) linear weights; None: PyTorch's default
    aux_noise: float  # uniform noise added to the aux states in training
    ttt_inputs: str  # data | drafter: the tokens of TTT steps >= 1
    max_batch_tokens: int
    shuffle_pool: int  # 0: fixed length-sorted batches; N: new batches each epoch (BatchPlan)
    packing: bool  # new random batches each epoch, several samples a row (BatchPlan)
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
    drafter: dict[str, Any]  # overrides of the drafter's sizes, and its EAGLE-3 variant
    target: TargetSettings  # path and trust_remote_code: the drafter's sizes from its config

    def recorded(self) -> dict[str, Any]:
        """The `train` section's values, as train_report.json and checkpoints record them: where
        the target lies is the run's, not the training's (moving it invalidates no checkpoint)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "target"}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TrainSettings:
        values = {k: config["train"][k] for k in cls.__dataclass_fields__ if k != "target"}
        target = TargetSettings.view(config, "path", "trust_remote_code")
        return cls(**{**values, "adam_betas": tuple(values["adam_betas"]), "target": target})


# The drafter's decoder layers: one, as every EAGLE-3 drafter vLLM and SGLang load.
DRAFTER_LAYERS = 1


def drafter_window(drafter: Mapping[str, Any]) -> int | None:
    """`train.drafter.sliding_window` as the drafter's one window (None: full attention): N, or a
    list with one entry (N or null) per decoder layer. Raises ValueError naming the key for what
    the drafter cannot be trained or served with."""
    value = drafter.get("sliding_window")
    if isinstance(value, list):
        if len(value) != DRAFTER_LAYERS:
            raise ValueError(
                f"train.drafter.sliding_window: {value} has {len(value)} entries, but the drafter "
                f"has {DRAFTER_LAYERS} decoder layer (one entry per layer, or one number)"
            )
        value = value[0]
    if value is not None and drafter.get("attention", "llama") == "mla":
        # deepseek_eagle3.py builds its MLA attention without a window (vLLM 0.32), and the
        # CPU MLA backend refuses one: vLLM would serve the drafter with full attention.
        raise ValueError(
            "train.drafter.sliding_window: vLLM serves the MLA drafter (attention: mla) with "
            "full attention only; set sliding_window: null or attention: llama"
        )
    return value
