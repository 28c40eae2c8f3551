"""The target as the stages that load its weights see it (hidden states, target head, training,
evaluation): where the weights are, how to load them, and the name recorded with their outputs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings


@dataclass(frozen=True)
class TargetModel(Settings):
    model: str
    path: str | None
    trust_remote_code: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TargetModel:
        target = config["target"]
        return cls(
            model=target["model"],
            path=target["path"],
            trust_remote_code=target["trust_remote_code"],
        )
