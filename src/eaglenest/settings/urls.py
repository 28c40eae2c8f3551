"""The URLs of a config: an endpoint's API base and the paths under it (the endpoints of
generation and probe, and the capture servers of the hidden-state stage), what makes two URLs one
server, and a URL as logs and files show it (without its credentials)."""

from __future__ import annotations

import urllib.parse

REDACTED = "<redacted>"
DEFAULT_PORTS = {"http": 80, "https": 443}


def api_base(url: str) -> str:
    """Normalise 'http://h:8000/v1/' and 'http://h:8000' to 'http://h:8000' (a query stays)."""
    parts = urllib.parse.urlsplit(url.strip())
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return urllib.parse.urlunsplit(parts._replace(path=path, fragment=""))


def endpoint_path(base: str, path: str) -> str:
    """`base` (an api_base) with `path` appended to its path, before any query it has."""
    parts = urllib.parse.urlsplit(base)
    return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + path))


def redacted_url(url: str) -> str:
    """`url` with its user info and every query value replaced (the query's names stay)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rsplit('@', 1)[1]}"
    query = "&".join(
        f"{name}={REDACTED}"
        for name, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


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
