"""Settings of the generate stage, in two objects: what shapes the request body (the rule's
`settings`: a change reruns generation, and the journal re-asks only the requests that changed)
and how the client sends it (its client settings: concurrency, timeouts, retries, endpoints,
which change no answer and rerun nothing)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings
from eaglenest.settings.endpoints import EndpointSettings
from eaglenest.settings.target import TargetSettings


@dataclass(frozen=True)
class RequestSettings(Settings):
    target: TargetSettings  # model (the served name) and chat_template_kwargs
    seed: int  # the run seed; each request's seed derives from it and the sample id
    temperature: float
    top_p: float
    max_tokens: int
    extra_body: dict[str, Any]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RequestSettings:
        generation = config["generation"]
        return cls(
            target=TargetSettings.view(config, "model", "chat_template_kwargs"),
            seed=config["seed"],
            **{k: generation[k] for k in ("temperature", "top_p", "max_tokens", "extra_body")},
        )


@dataclass(frozen=True)
class GenerationClientSettings(Settings):
    endpoints: EndpointSettings
    concurrency: int
    stream: str  # auto (as the probe's dialect allows), always or never
    idle_timeout_s: float  # a streamed request fails after this long without a chunk
    timeout_s: float | None  # optional limit on a request that is not streamed
    slots_dir: str | None  # where the per-endpoint slot locks live (None: the host's temp dir)
    activity_s: float  # how often the in-flight count and the server's queue are sampled
    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float
    retry_after_max_s: float
    max_error_fraction: float
    bench_after_failures: int
    bench_s: float

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> GenerationClientSettings:
        generation = config["generation"]
        names = [f for f in cls.__dataclass_fields__ if f != "endpoints"]
        return cls(
            endpoints=EndpointSettings.from_config(config), **{k: generation[k] for k in names}
        )
