"""The endpoints a job talks to: the configured vLLM/SGLang servers, or eaglenest's embedded
server, started for exactly the duration of the job that needs it."""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eaglenest.client.credentials import redacted_url
from eaglenest.client.urls import api_base
from eaglenest.settings.endpoints import EndpointSettings

DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Endpoint:
    url: str  # base URL without the /v1 suffix; used as written (with any credentials) to send
    api_key_env: str | None = None
    max_concurrency: int = 128

    @property
    def name(self) -> str:
        """The URL as logs, files and the slot lock show it: without its credentials."""
        return redacted_url(self.url)


def endpoint_identity(url: str) -> str:
    """What makes two URLs one server: scheme, host and port (defaults filled in), and path,
    compared without case where case does not matter; credentials and query aside."""
    parts = urllib.parse.urlsplit(api_base(url))
    port = parts.port or DEFAULT_PORTS.get(parts.scheme.lower())
    return f"{parts.scheme.lower()}://{(parts.hostname or '').lower()}:{port}{parts.path}"


def check_distinct(urls: list[str]) -> None:
    """Refuse an endpoint listed twice: two slot sets would share one lock file in one process,
    whose record locks do not exclude each other, so the job would send twice the cap."""
    seen: dict[str, int] = {}
    for i, url in enumerate(urls):
        first = seen.setdefault(endpoint_identity(url), i)
        if first != i:
            raise ValueError(
                f"config key 'endpoints': entries {first} ({redacted_url(urls[first])}) and {i} "
                f"({redacted_url(url)}) are the same endpoint; list it once, with the "
                "max_concurrency it takes"
            )


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
            url=api_base(e["url"]),
            api_key_env=e["api_key_env"],
            max_concurrency=e["max_concurrency"],
        )
        for e in settings.endpoints
    ]
