"""API keys: read from the environment variable named in config, never stored anywhere.

Config holds only the variable's *name*; the key travels only in request headers. A URL may carry
credentials of its own (`http://user:pass@host`, `?key=...`): it is used as written for requests,
and shown everywhere else (logs, raw rows, activity files, the report) as `redacted_url` shows it. `redact` scrubs
it from error texts, which can quote what a proxy echoed of the request. Never from the model's
text: a short key such as vLLM's dummy `EMPTY` would corrupt every answer that says the word."""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

from eaglenest.settings.urls import REDACTED


def api_key_from_env(var_name: str | None) -> str | None:
    """The key held by `var_name`; a named but unset variable is an error, not a silent no-key."""
    if not var_name:
        return None
    value = os.environ.get(var_name)
    if value is None:
        raise KeyError(
            f"config names api_key_env '{var_name}' but that environment variable is not set"
        )
    return value


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def redact(value: Any, secrets: list[str | None]) -> Any:
    """Return `value` (JSON-like) with every occurrence of each secret replaced."""
    secrets = [s for s in secrets if s]
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {k: redact(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, secrets) for v in value]
    return value


def url_secrets(url: str) -> list[str]:
    """The credentials a URL carries: its user info (user and password) and its query values."""
    parts = urllib.parse.urlsplit(url)
    found = [parts.username, parts.password]
    found += [value for _, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)]
    return [unquoted for value in found if value for unquoted in {value, urllib.parse.quote(value)}]
