"""Settings of the demo target's build: the `demo_target` section less `enabled` (which decides
whether the rule runs at all)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings


@dataclass(frozen=True)
class DemoTargetSettings(Settings):
    seed: int
    tasks: str  # "short" (the embedded demo), "long" (the long-reasoning demo) or "cite"
    architecture: str
    layout: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    train_steps: int
    batch_size: int
    learning_rate: float
    train_window_tokens: int | None
    heldout_prompts: int
    heldout_max_new_tokens: int
    min_reasoning_share: float
    deepseek_v3: dict[str, Any]
    cite: dict[str, Any]  # the collapsing demo's shape (tasks cite: eaglenest.demo.cite_tasks)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DemoTargetSettings:
        return cls(**{k: config["demo_target"][k] for k in cls.__dataclass_fields__})
