"""Settings of the evaluate stage: the `evaluate` section and the seed of the run's training (the
untrained baseline and the batch order draw from it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings
from eaglenest.settings.target import TargetSettings
from eaglenest.settings.vllm import VllmEngine


@dataclass(frozen=True)
class EvaluateSettings(Settings):
    ks: tuple[int, ...]
    depths: tuple[int, ...]  # context depths of the by-depth table (empty: none)
    live: bool
    live_prompts: int
    live_max_new_tokens: int
    device: str  # "auto" (eaglenest.common.devices.resolve_device) or a torch device
    prompt_lookup_ngram: int
    max_batch_tokens: int
    seed: int  # train.seed
    engine: str | None  # "vllm": also decode in the serving engine
    vllm: VllmEngine | None  # with engine "vllm" only: a vllm section change reruns only then
    target: TargetSettings  # path and trust_remote_code

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EvaluateSettings:
        section = config["evaluate"]
        fixed = ("ks", "depths", "seed", "vllm", "target")
        names = [f for f in cls.__dataclass_fields__ if f not in fixed]
        return cls(
            ks=tuple(section["ks"]),
            depths=tuple(section["depths"]),
            seed=config["train"]["seed"],
            vllm=VllmEngine.from_config(config) if section["engine"] == "vllm" else None,
            target=TargetSettings.view(config, "path", "trust_remote_code"),
            **{k: section[k] for k in names},
        )
