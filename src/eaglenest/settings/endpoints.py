"""How a job reaches the target's server: the configured endpoints, or eaglenest's embedded
server over the target. Part of the client settings of the stages that send requests (probe,
generate), which shape no output: the same model answers the same request wherever it is
served, so a new URL, key or concurrency cap reruns nothing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings
from eaglenest.settings.target import TargetSettings

# The target fields the embedded server reads.
SERVED = ("model", "path", "tokenizer", "trust_remote_code")


@dataclass(frozen=True)
class EndpointSettings(Settings):
    endpoints: tuple[dict[str, Any], ...]  # the `endpoints` section: url, api_key_env, ...
    server: dict[str, Any]  # the `server` section: the embedded server, when enabled
    # What the embedded server serves: the target's model name, path, tokenizer and loading.
    target: TargetSettings

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EndpointSettings:
        return cls(
            endpoints=tuple(dict(e) for e in config["endpoints"]),
            server=dict(config["server"]),
            target=TargetSettings.view(config, *SERVED),
        )

    def embedded_server_config(self) -> dict[str, Any]:
        """The `target` and `server` sections, as `embedded_server` reads them."""
        return {"target": {k: getattr(self.target, k) for k in SERVED}, "server": self.server}
