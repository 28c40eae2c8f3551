"""An endpoint's URLs: its API base and the paths under it (the endpoints of generation and
probe, and the capture server of the hidden-state stage)."""

from __future__ import annotations

import urllib.parse


def api_base(url: str) -> str:
    """Normalise 'http://h:8000/v1/' and 'http://h:8000' to 'http://h:8000' (a query stays)."""
    parts = urllib.parse.urlsplit(url.strip())
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return urllib.parse.urlunsplit(parts._replace(path=path, fragment=""))


def endpoint_path(base: str, path: str) -> str:
    """`base` (an api_base) with `path` appended to its path, before any query it has."""
    parts = urllib.parse.urlsplit(base)
    return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + path))
