"""The endpoints a job talks to: the configured vLLM/SGLang servers, or eaglenest's embedded
server, started for exactly the duration of the job that needs it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eaglenest.settings.endpoints import EndpointSettings
from eaglenest.settings.urls import api_base, check_distinct, normalized_url, redacted_url


@dataclass(frozen=True)
class Endpoint:
    # Base URL, normalised (settings/urls.normalized_url: no /v1 suffix, scheme and host
    # lowercased); its credentials as written, to send.
    url: str
    api_key_env: str | None = None
    max_concurrency: int = 128

    @property
    def name(self) -> str:
        """The URL as logs, files and the slot lock show it: without its credentials."""
        return redacted_url(self.url)


@contextlib.contextmanager
def open_endpoints(
    settings: EndpointSettings, server_log: str | Path | None
) -> Iterator[list[Endpoint]]:
    """Yield the endpoints of the run; with `server.enabled` the embedded server is running inside
    the block and is stopped when it ends, also on failure."""
    if settings.server["enabled"]:
        from eaglenest.demo.server_process import embedded_server

        with embedded_server(settings.embedded_server_config(), log_path=server_log) as url:
            yield [Endpoint(url=api_base(url), max_concurrency=settings.server["max_batch_size"])]
        return
    if not settings.endpoints:
        raise ValueError(
            "config key 'endpoints' is empty and 'server.enabled' is false: "
            "list at least one endpoint URL (e.g. endpoints: [{url: http://host:8000}])"
        )
    check_distinct([e["url"] for e in settings.endpoints])
    yield [
        Endpoint(
            url=normalized_url(e["url"], f"endpoints[{i}].url"),
            api_key_env=e["api_key_env"],
            max_concurrency=e["max_concurrency"],
        )
        for i, e in enumerate(settings.endpoints)
    ]
