"""Settings of the vocabulary stage: the draft vocabulary's size (tokenize.draft_vocab_size),
apart from the tokenize settings, so that changing it rebuilds only the vocabulary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings


@dataclass(frozen=True)
class VocabSettings(Settings):
    draft_vocab_size: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VocabSettings:
        return cls(draft_vocab_size=config["tokenize"]["draft_vocab_size"])
