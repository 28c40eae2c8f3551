"""The URLs of a config: an endpoint's API base and the paths under it (the endpoints of
generation and probe, and the capture servers of the hidden-state stage), what makes two URLs one
server, and a URL as logs and files show it (without its credentials).

Both kinds of server URL are checked and normalised alike (`normalized_url`, `normalized_urls`):
an http or https scheme and a host are required (a URL without a scheme is refused naming its
config key: it would otherwise be read as a path, and fail later as a bare client error), the
scheme and host lowercased, a trailing `/v1` and trailing slashes dropped; two URLs of one server
after that are refused naming both spellings (twice the cap on one server otherwise).
`check_config_urls` is the config check of both, before any job runs."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
DEFAULT_PORTS = {"http": 80, "https": 443}


def api_base(url: str) -> str:
    """Normalise 'http://h:8000/v1/' and 'http://h:8000' to 'http://h:8000' (a query stays)."""
    parts = urllib.parse.urlsplit(url.strip())
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return urllib.parse.urlunsplit(parts._replace(path=path, fragment=""))


class UrlError(ValueError):
    """A server URL of the config is unusable; the message names the config key."""


def normalized_url(url: str, key: str) -> str:
    """`url` as one spelling of its server: scheme and host lowercased, no trailing `/v1` or
    slashes, no fragment (user info, port and query as written). Raises UrlError naming `key`
    for a URL without an http(s) scheme, a host or a valid port."""
    written = str(url).strip()
    parts = urllib.parse.urlsplit(written)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        hint = (
            f"it has no scheme: write http://{written} (or https://)"
            if "://" not in written
            else f"its scheme {parts.scheme!r} is not http or https"
        )
        raise UrlError(f"config key '{key}': {redacted_url(written)!r}: {hint}")
    try:
        port = parts.port
    except ValueError as err:
        raise UrlError(f"config key '{key}': {redacted_url(written)!r}: {err}") from None
    if not parts.hostname:
        raise UrlError(f"config key '{key}': {redacted_url(written)!r} names no host")
    host = parts.hostname.lower()
    netloc = f"[{host}]" if ":" in host else host  # an IPv6 address keeps its brackets
    if port is not None:
        netloc += f":{port}"
    if "@" in parts.netloc:
        netloc = parts.netloc.rsplit("@", 1)[0] + "@" + netloc
    normal = urllib.parse.urlunsplit((scheme, netloc, parts.path, parts.query, ""))
    return api_base(normal)


def normalized_urls(urls: list[str], key: str) -> list[str]:
    """Each of `urls` normalised; a server listed twice (after normalisation) is refused,
    naming both spellings as written."""
    seen: dict[str, int] = {}
    normal = []
    for i, url in enumerate(urls):
        one = normalized_url(url, key)
        first = seen.setdefault(endpoint_identity(one), i)
        if first != i:
            raise UrlError(
                f"config key '{key}': {redacted_url(urls[first])!r} and {redacted_url(url)!r} "
                "are the same server; list it once"
            )
        normal.append(one)
    return normal


def capture_urls(section: Mapping[str, Any]) -> tuple[str, ...]:
    """`vllm.capture_urls` then `vllm.capture_url`, normalised (normalized_url: an http(s)
    scheme and a host required, case, a trailing `/v1` and slashes dropped). A server listed
    twice in `capture_urls` is refused; `capture_url`, the one-server form, may repeat one."""
    urls = list(normalized_urls(list(section.get("capture_urls") or []), "vllm.capture_urls"))
    single = section.get("capture_url")
    if single:
        one = normalized_url(single, "vllm.capture_url")
        if endpoint_identity(one) not in {endpoint_identity(url) for url in urls}:
            urls.append(one)
    return tuple(urls)


def check_config_urls(config: Mapping[str, Any]) -> None:
    """The config check of every server URL (generation's endpoints, the capture servers), so
    that a bad one fails the run before any job runs."""
    check_distinct([e["url"] for e in config.get("endpoints") or []])
    capture_urls(config.get("vllm") or {})


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
    """Refuse an endpoint without an http(s) scheme or a host, or listed twice: two slot sets
    would share one lock file in one process, whose record locks do not exclude each other, so
    the job would send twice the cap."""
    seen: dict[str, int] = {}
    for i, url in enumerate(urls):
        normalized_url(url, f"endpoints[{i}].url")
        first = seen.setdefault(endpoint_identity(url), i)
        if first != i:
            raise ValueError(
                f"config key 'endpoints': entries {first} ({redacted_url(urls[first])}) and {i} "
                f"({redacted_url(url)}) are the same endpoint; list it once, with the "
                "max_concurrency it takes"
            )
