"""One chat-completions request: sent plain or streamed, read back as one body, and sorted into
an answer, a failure worth retrying or a terminal failure.

A streamed request fails when no chunk arrives for `idle_timeout_s`, never because the answer is
long: a 30K-token answer that keeps streaming is never cut. `timeout_s` (optional) bounds a request
that is not streamed, which has nothing else to bound it: the server sends nothing until the
answer is done.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from eaglenest.client.endpoints import Endpoint
from eaglenest.client.retry import RETRYABLE_STATUS, retry_after_s
from eaglenest.client.streaming import STREAM_FIELDS, TEXT_FIELDS, StreamAssembler, StreamError
from eaglenest.settings.urls import endpoint_path


class RetryableError(Exception):
    def __init__(self, kind: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s


class TerminalError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


# Bodies are read up to these sizes: a server (or proxy) that sends without end must not take the
# job's memory. A 128K-token answer streamed with its ids is some 40 MB of events.
MAX_BODY_BYTES = 256 << 20
MAX_ERROR_BODY_BYTES = 64 << 10


async def read_event_stream(response: aiohttp.ClientResponse) -> dict[str, Any]:
    """Assemble a streamed answer. Lines are split here rather than by aiohttp's readline, whose
    line limit (128 KiB) a first chunk carrying a 32K-token prompt's ids exceeds; only new data
    is searched for line ends, so a long line costs linear time."""
    assembler = StreamAssembler()
    pending = bytearray()
    received = 0
    async for data in response.content.iter_any():
        received += len(data)
        if received > MAX_BODY_BYTES:
            raise StreamError("body_too_large", f"the stream passed {MAX_BODY_BYTES} bytes")
        if b"\n" not in data:
            pending += data
            continue
        first, *lines, rest = data.split(b"\n")
        pending += first
        for line in (pending, *lines):
            _feed_line(assembler, line)
        pending = bytearray(rest)
    _feed_line(assembler, pending)
    if not assembler.complete:
        raise StreamError(
            "stream_cut",
            f"the stream ended after {assembler.chunks} chunks without a finish reason",
        )
    return assembler.response()


def _feed_line(assembler: StreamAssembler, line: bytes | bytearray) -> None:
    try:
        text = line.decode()
    except UnicodeDecodeError as err:
        raise StreamError("malformed_body", f"an event is not UTF-8: {err}") from err
    assembler.feed_line(text)


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body, or None when it passes `limit` bytes (read no further)."""
    data = bytearray()
    async for piece in response.content.iter_any():
        data += piece
        if len(data) > limit:
            return None
    return bytes(data)


async def error_text(response: aiohttp.ClientResponse, limit: int) -> str:
    """The start of an error body as text, whatever its size or encoding."""
    data = bytearray()
    while len(data) < MAX_ERROR_BODY_BYTES:
        piece = await response.content.read(MAX_ERROR_BODY_BYTES - len(data))
        if not piece:
            break
        data += piece
    return data.decode(errors="replace")[:limit]


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
    url = endpoint_path(endpoint.url, "/v1/chat/completions")
    sent = body | STREAM_FIELDS if stream else body
    try:
        async with session.post(
            url, json=sent, headers=headers, timeout=_timeout(stream, timeout_s, idle_timeout_s)
        ) as response:
            if response.status in RETRYABLE_STATUS:
                raise RetryableError(
                    f"http_{response.status}",
                    await error_text(response, 300),
                    retry_after_s(response.headers.get("Retry-After")),
                )
            if response.status != 200:
                raise TerminalError(f"http_{response.status}", await error_text(response, 500))
            if response.content_type == "text/event-stream":
                parsed = await read_event_stream(response)
                return _checked(parsed, body), json.dumps(parsed)
            data = await read_capped(response, MAX_BODY_BYTES)  # a server that ignored `stream`
    except aiohttp.SocketTimeoutError as err:  # sock_read: nothing arrived for a while
        raise RetryableError("idle_timeout", f"no data for {idle_timeout_s} s") from err
    except asyncio.TimeoutError as err:
        raise RetryableError("timeout", f"no complete answer within {timeout_s} s") from err
    except aiohttp.ClientError as err:
        raise RetryableError("connection", f"{type(err).__name__}: {err}") from err
    except StreamError as err:
        raise RetryableError(err.kind, str(err)) from err
    if data is None:
        raise RetryableError("body_too_large", f"the answer passed {MAX_BODY_BYTES} bytes")
    try:
        text = data.decode()
        parsed = json.loads(text)
    except UnicodeDecodeError as err:
        raise RetryableError("malformed_body", f"the answer is not UTF-8: {err}") from err
    except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: deep nesting
        raise RetryableError("malformed_json", f"{err}: {text[:200]!r}") from err
    return _checked(parsed, body), text


def answer_problem(parsed: Any) -> str | None:
    """What makes a 200 body no answer the raw file can hold (None when it is one): the fields a
    row is made of must have their types, and every text must be encodable (a lone surrogate
    such as "\\ud800" is valid JSON but no UTF-8, and would fail the raw file's writer)."""
    if not isinstance(parsed, dict):
        return f"the body is a {type(parsed).__name__}, not an object"
    choices = parsed.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "no choices in body, or choices[0] is not an object"
    choice = choices[0]
    message = choice.get("message")
    if message is not None and not isinstance(message, dict):
        return "choices[0].message is not an object"
    fields = {f"message.{k}": v for k, v in (message or {}).items() if k in TEXT_FIELDS}
    fields |= {"finish_reason": choice.get("finish_reason"), "model": parsed.get("model")}
    for name, value in fields.items():
        if value is not None and not isinstance(value, str):
            return f"{name} is a {type(value).__name__}, not a string"
    usage = parsed.get("usage")
    if usage is not None and not isinstance(usage, dict):
        return "usage is not an object"
    for name in ("prompt_tokens", "completion_tokens"):
        count = (usage or {}).get(name)
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
            return f"usage.{name} is {count!r}, not an integer"
        if count is not None and not 0 <= count < 2**63:
            return f"usage.{name} is {count}, not a count"
    try:
        json.dumps(parsed, ensure_ascii=False).encode()
    except UnicodeEncodeError as err:
        return f"a text is not valid Unicode: {err}"
    return None


def _checked(parsed: Any, body: dict) -> dict:
    problem = answer_problem(parsed)
    if problem is not None:
        raise RetryableError("malformed_answer", problem)
    answered_by = parsed.get("model")
    if answered_by is not None and answered_by != body["model"]:
        # A router or proxy sent the request to another model: its answer is not the target's.
        raise TerminalError(
            "model_mismatch", f"asked model {body['model']!r}, answered by {answered_by!r}"
        )
    return parsed
