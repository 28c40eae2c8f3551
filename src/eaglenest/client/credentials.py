"""API keys: read from the environment variable named in config, never stored anywhere.

Config holds only the variable's *name*; the key travels only in request headers. A URL may carry
credentials of its own (`http://user:pass@host`, `?key=...`): it is used as written for requests,
and shown everywhere else (logs, raw rows, activity files, the report) as `redacted_url` shows
it. `redact` scrubs it from error texts and servers' answers, which can quote what a proxy echoed
of the request: the secrets it is given (the key; a URL's user, password, query values and the
Basic-auth header made of them), and whatever has a credential's form (an Authorization header's
value, a URL's user info, a credential-named query key's value). Never from the model's text: a
short key such as vLLM's dummy `EMPTY` would corrupt every answer that says the word."""

from __future__ import annotations

import base64
import os
import re
import urllib.parse
from typing import Any

from eaglenest.settings.urls import REDACTED

# A credential's form in a text, whatever its value: an Authorization header as a proxy echoes it
# (`Authorization: Basic ...`, `'authorization': 'Bearer ...'`), a bare bearer token, a URL's
# user info, and the value of a query key that names a credential (`?key=`, `api_key=`,
# `token=`, `access_token=`, `password=`, `sig=` ...).
_CREDENTIAL_FORMS = (
    (
        re.compile(
            r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?\s*(?:basic|bearer|token)\s+)[^\s\"',;}]+"
        ),
        rf"\1{REDACTED}",
    ),
    (re.compile(r"(?i)(\bbearer\s+)(?!<redacted>)[A-Za-z0-9._~+/=-]{8,}"), rf"\1{REDACTED}"),
    (re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://)[^/\s@\"'<>]+@"), rf"\1{REDACTED}@"),
    (
        re.compile(
            r"(?i)([?&;][\w.-]*(?:key|token|secret|password|passwd|pwd|sig|signature|auth|"
            r"credential)[\w.-]*=)[^&#\s\"'<>]+"
        ),
        rf"\1{REDACTED}",
    ),
)


CREDENTIAL_NAME = re.compile(r"(?i)key|token|secret|passw|pwd|sig|auth|credential")
MIN_QUERY_SECRET = 6


class ApiKeyError(ValueError):
    """The variable an endpoint's `api_key_env` names holds no usable key; the message names it."""


def api_key_from_env(var_name: str | None, key: str = "endpoints[].api_key_env") -> str | None:
    """The key held by `var_name`; a named but unset variable, or one of only blanks (a header
    `Bearer ` and blanks is refused by the client: it read as "unreachable"), is an error naming
    it, not a silent no-key. An empty one sends no key (a server that takes none), and says so
    where a server refuses it (`key_hint`)."""
    if not var_name:
        return None
    value = os.environ.get(var_name)
    if value is None:
        raise ApiKeyError(
            f"{key} names the environment variable {var_name}, which is not set: export the "
            "server's key in it"
        )
    if value and not value.strip():
        raise ApiKeyError(
            f"{key} names the environment variable {var_name}, which holds only blanks: export "
            "the server's key in it (or leave it empty for a server that takes none)"
        )
    return value


def key_hint(
    var_name: str | None, api_key: str | None, key: str = "endpoints[].api_key_env"
) -> str:
    """What a user reads beside a server's 401/403: which key was sent, or why none was."""
    if not var_name:
        return f"no key was sent ({key} names no variable): set it to the variable holding the key"
    if not api_key:
        return f"no key was sent: {key} names {var_name}, which is empty; export the key in it"
    return f"the key of {var_name} ({key}) was refused: export the key this server takes"


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def redact(value: Any, secrets: list[str | None]) -> Any:
    """Return `value` (JSON-like: an error text, a server's answer) with every occurrence of each
    secret replaced, and every credential's form (_CREDENTIAL_FORMS)."""
    secrets = sorted({s for s in secrets if s}, key=len, reverse=True)  # a longer one first
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        for form, replacement in _CREDENTIAL_FORMS:
            value = form.sub(replacement, value)
        return value
    if isinstance(value, dict):
        return {k: redact(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, secrets) for v in value]
    return value


def url_secrets(url: str) -> list[str]:
    """The credentials a URL carries: its user info (user and password, as written and as the
    Basic-auth header the clients make of them) and its query values (a short one only under a
    credential's name: `?v=1` must not blank every 1 of a message)."""
    parts = urllib.parse.urlsplit(url)
    user = urllib.parse.unquote(parts.username or "")
    password = urllib.parse.unquote(parts.password or "")
    found = [parts.username, parts.password, user, password]
    found += [
        value
        for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if len(value) >= MIN_QUERY_SECRET or CREDENTIAL_NAME.search(name)
    ]
    if user or password:
        pair = f"{user}:{password}"
        for encoding in ("utf-8", "latin-1"):  # httpx's, aiohttp's
            try:
                found.append(base64.b64encode(pair.encode(encoding)).decode())
            except UnicodeEncodeError:
                continue
    return [unquoted for value in found if value for unquoted in {value, urllib.parse.quote(value)}]
