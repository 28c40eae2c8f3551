"""Settings of the probe stage: what it asks each endpoint and what it requires of the answers
(the rule's `settings`), and how it reaches them (its client settings, no reason to rerun).

Where eaglenest's embedded server is the endpoint, how that server answers (its dialect, whether
it returns token ids, its faults) is part of the settings: the pipeline runs that server, so it
can see what changed, and probe.json (which every later stage reads) records what it found. A
real endpoint's own configuration is out of sight; after changing it, rerun the probe:
`snakemake --forcerun probe_endpoints`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings
from eaglenest.settings.endpoints import EndpointSettings
from eaglenest.settings.target import TargetSettings


@dataclass(frozen=True)
class ProbeSettings(Settings):
    # All of it: the probe asks as the run will (model, chat_template_kwargs) and resolves the
    # think token ids (tokenizer, else path; think_tokens) that every later stage reads from
    # probe.json.
    target: TargetSettings
    extra_body: dict[str, Any]  # generation.extra_body: the probe asks as the run will
    prompts: int
    prompt: str | None
    max_tokens: int
    require_token_ids: bool
    require_reasoning: bool
    embedded_server: dict[str, Any] | None  # the `server` section less client settings, if enabled

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ProbeSettings:
        probe = config["probe"]
        return cls(
            target=TargetSettings.from_config(config),
            extra_body=config["generation"]["extra_body"],
            embedded_server=_answer_settings(config["server"]),
            **{
                k: probe[k]
                for k in (
                    "prompts",
                    "prompt",
                    "max_tokens",
                    "require_token_ids",
                    "require_reasoning",
                )
            },
        )


# How long the embedded server may take to start and how many requests it batches: how it runs,
# not what it answers. Its backend too: the cite target's rule answers with the very tokens its
# model's greedy decoding writes (the target's build proves it), so a switch regenerates nothing.
SERVER_CLIENT_KEYS = ("enabled", "backend", "max_batch_size", "startup_timeout_s")


def _answer_settings(server: Mapping[str, Any]) -> dict[str, Any] | None:
    if not server["enabled"]:
        return None
    return {k: v for k, v in server.items() if k not in SERVER_CLIENT_KEYS}


@dataclass(frozen=True)
class ProbeClientSettings(Settings):
    endpoints: EndpointSettings
    timeout_s: float

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ProbeClientSettings:
        return cls(
            endpoints=EndpointSettings.from_config(config), timeout_s=config["probe"]["timeout_s"]
        )
