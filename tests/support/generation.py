"""Generation settings for tests against the embedded server in echo mode (the client is under
test, not the model): the config's two settings objects and fast retries."""

from __future__ import annotations

from eaglenest.common.config import validate_config
from eaglenest.settings.generate import GenerationClientSettings, RequestSettings
from eaglenest.stages.generate.request import GenerationSettings

MODEL = "echo-model"  # the model name the embedded server answers as in echo mode


def shard_settings(config: dict) -> tuple[RequestSettings, GenerationClientSettings]:
    """generate_shard's two settings objects from a validated config, as the rule makes them."""
    return RequestSettings.from_config(config), GenerationClientSettings.from_config(config)


def generation_settings(model: str = MODEL, **generation) -> GenerationSettings:
    """The settings of a config that sets the target's model and `generation` only."""
    config = validate_config({"target": {"model": model}, "generation": generation})
    return GenerationSettings.from_parts(*shard_settings(config), return_token_ids=True)


def fast_settings(**overrides) -> GenerationSettings:
    values = {
        "concurrency": 32,
        "timeout_s": 1.0,
        "idle_timeout_s": 1.0,
        "max_attempts": 8,
        "backoff_base_s": 0.02,
        "backoff_max_s": 0.2,
        "bench_s": 0.2,
    }
    values.update(overrides)
    return generation_settings(**values)
