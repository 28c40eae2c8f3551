"""One chat-completions request: sent plain or streamed, read back as one body, and sorted into
an answer, a failure worth retrying or a terminal failure.

A streamed request fails when no chunk arrives for `idle_timeout_s`, never because the answer is
long: a 30K-token answer that keeps streaming is never cut. `timeout_s` (optional) bounds a request
that is not streamed, which has nothing else to bound it: the server sends nothing until the
answer is done.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import json
import time
from typing import Any

import aiohttp

from eaglenest.client.endpoints import Endpoint
from eaglenest.client.streaming import StreamAssembler, StreamError

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
# Added to a request that streams: the usage arrives in a last chunk only when asked for.
STREAM_FIELDS = {"stream": True, "stream_options": {"include_usage": True}}


class RetryableError(Exception):
    def __init__(self, kind: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s


class TerminalError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds a `Retry-After` header asks to wait: delay-seconds or an HTTP date (RFC 9110);
    None when absent or unreadable. Capping is the caller's."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # an obsolete date form without a zone: HTTP dates are GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


async def read_event_stream(response: aiohttp.ClientResponse) -> dict[str, Any]:
    """Assemble a streamed answer. Lines are split here rather than by aiohttp's readline, whose
    line limit (128 KiB) a first chunk carrying a 32K-token prompt's ids exceeds."""
    assembler = StreamAssembler()
    pending = b""
    async for data in response.content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            assembler.feed_line(line.decode())
    assembler.feed_line(pending.decode())
    if not assembler.complete:
        raise StreamError(
            "stream_cut",
            f"the stream ended after {assembler.chunks} chunks without a finish reason",
        )
    return assembler.response()


def _timeout(stream: bool, timeout_s: float | None, idle_timeout_s: float) -> aiohttp.ClientTimeout:
    if stream:  # sock_read also bounds the wait for the response's head (a queued request)
        return aiohttp.ClientTimeout(total=None, sock_read=idle_timeout_s)
    return aiohttp.ClientTimeout(total=timeout_s)


async def post_once(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    body: dict,
    headers: dict,
    *,
    stream: bool,
    timeout_s: float | None,
    idle_timeout_s: float,
) -> tuple[dict, str]:
    """One POST; returns (body, its text) or raises RetryableError / TerminalError. A streamed
    answer's body is the assembled one (see eaglenest.client.streaming)."""
    url = f"{endpoint.url}/v1/chat/completions"
    sent = body | STREAM_FIELDS if stream else body
    try:
        async with session.post(
            url, json=sent, headers=headers, timeout=_timeout(stream, timeout_s, idle_timeout_s)
        ) as response:
            if response.status in RETRYABLE_STATUS:
                raise RetryableError(
                    f"http_{response.status}",
                    (await response.text())[:300],
                    retry_after_s(response.headers.get("Retry-After")),
                )
            if response.status != 200:
                raise TerminalError(f"http_{response.status}", (await response.text())[:500])
            if response.content_type == "text/event-stream":
                parsed = await read_event_stream(response)
                return _checked(parsed, body), json.dumps(parsed)
            text = await response.text()  # a server that ignored `stream` answers plainly
    except aiohttp.SocketTimeoutError as err:  # sock_read: nothing arrived for a while
        raise RetryableError("idle_timeout", f"no data for {idle_timeout_s} s") from err
    except asyncio.TimeoutError as err:
        raise RetryableError("timeout", f"no complete answer within {timeout_s} s") from err
    except aiohttp.ClientError as err:
        raise RetryableError("connection", f"{type(err).__name__}: {err}") from err
    except StreamError as err:
        raise RetryableError(err.kind, str(err)) from err
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        raise RetryableError("malformed_json", f"{err}: {text[:200]!r}") from err
    return _checked(parsed, body), text


def _checked(parsed: Any, body: dict) -> dict:
    if not isinstance(parsed, dict) or not parsed.get("choices"):
        raise RetryableError("malformed_json", f"no choices in body: {json.dumps(parsed)[:200]!r}")
    answered_by = parsed.get("model")
    if answered_by is not None and answered_by != body["model"]:
        # A router or proxy sent the request to another model: its answer is not the target's.
        raise TerminalError(
            "model_mismatch", f"asked model {body['model']!r}, answered by {answered_by!r}"
        )
    return parsed
