"""Settings of the samples stage (one job per shard: validate the raw answers, then tokenize the
samples that pass), each step's in its own object; together the rule's `settings`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings
from eaglenest.settings.target import TargetSettings


@dataclass(frozen=True)
class ValidationSettings(Settings):
    """The `validation` section: when a shard stops the pipeline."""

    max_empty_reasoning_fraction: float
    max_truncated_fraction: float
    max_bad_token_ids_fraction: float

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ValidationSettings:
        return cls(**{k: config["validation"][k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class TokenizeSettings(Settings):
    """The `tokenize` section less draft_vocab_size (which reruns only the vocabulary), and the
    target's tokenizer. The think token ids are not here: the probe resolved them once, and
    tokenize reads them from probe.json."""

    max_length: int | None
    overlength: str  # "drop" or "truncate"
    end_of_turn_token: str | None
    verify_rebuild: bool
    max_mismatches_logged: int
    min_agreement: float
    target: TargetSettings  # path, tokenizer, trust_remote_code and chat_template_kwargs

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TokenizeSettings:
        names = [f for f in cls.__dataclass_fields__ if f != "target"]
        fields = (
            "path",
            "tokenizer",
            "trust_remote_code",
            "chat_template_kwargs",
            "reasoning_parser",
        )
        target = TargetSettings.view(config, *fields)
        return cls(target=target, **{k: config["tokenize"][k] for k in names})


@dataclass(frozen=True)
class SamplesSettings(Settings):
    validation: ValidationSettings
    tokenize: TokenizeSettings

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SamplesSettings:
        return cls(
            validation=ValidationSettings.from_config(config),
            tokenize=TokenizeSettings.from_config(config),
        )
