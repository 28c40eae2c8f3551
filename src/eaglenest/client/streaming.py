"""Streamed chat completions (server-sent events) assembled into the body a non-streamed request
would have returned, so the raw file and every later stage see one shape whichever way the answer
travelled.

vLLM (with `return_token_ids`) sends `prompt_token_ids` in the first chunk and each chunk's new
ids in `choices[0].token_ids`; text arrives as `delta.content` and, with a reasoning parser,
`delta.reasoning` (older versions: `delta.reasoning_content`). The usage comes in a last chunk
without choices when `stream_options.include_usage` is set. The assembled body keeps the
reasoning under the field the server used, so the reasoning field is recorded as for a
non-streamed answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Delta fields whose text is concatenated into the message, in the server's own names.
TEXT_FIELDS = ("content", "reasoning", "reasoning_content")
# Added to a request that streams: the usage arrives in a last chunk only when asked for.
STREAM_FIELDS = {"stream": True, "stream_options": {"include_usage": True}}
DONE = "[DONE]"


class StreamError(ValueError):
    """The stream said something no answer can be assembled from (kind names what)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class StreamAssembler:
    """Feed it the `data:` payloads of a stream in order; `response()` is the assembled body."""

    chunks: int = 0
    done: bool = False
    head: dict[str, Any] = field(default_factory=dict)  # id, created, model of the first chunk
    prompt_token_ids: list[int] | None = None
    token_ids: list[Any] | None = None
    text: dict[str, list[str]] = field(default_factory=dict)  # field -> pieces
    finish_reason: str | None = None
    stop_reason: Any = None
    usage: dict[str, Any] | None = None

    def feed_line(self, line: str) -> None:
        """One line of the event stream (blank lines, comments and other fields are skipped)."""
        line = line.strip()
        if not line.startswith("data:"):
            return
        payload = line.removeprefix("data:").strip()
        if payload == DONE:
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: deep nesting
            raise StreamError("malformed_json", f"{err}: {payload[:200]!r}") from err
        self.feed(chunk)

    def feed(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise StreamError("malformed_json", f"a chunk is not an object: {chunk!r:.200}")
        if "error" in chunk:  # vLLM reports a failure inside a running stream this way
            raise StreamError("stream_error", json.dumps(chunk["error"])[:500])
        self.chunks += 1
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_token_ids = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise StreamError("malformed_json", f"choices is not a list: {choices!r:.200}")
        for choice in choices:
            self._feed_choice(choice)

    def _feed_choice(self, choice: Any) -> None:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or not isinstance(delta or {}, dict):
            raise StreamError(
                "malformed_json", f"a choice or its delta is not an object: {choice!r:.200}"
            )
        if choice.get("index", 0) != 0:
            return
        for name in TEXT_FIELDS:
            if isinstance((delta or {}).get(name), str):
                self.text.setdefault(name, []).append(delta[name])
        if isinstance(choice.get("token_ids"), list):
            # Extended in place: vLLM sends one id per chunk, and a copy per chunk is O(n^2).
            if self.token_ids is None:
                self.token_ids = []
            self.token_ids.extend(choice["token_ids"])
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")

    @property
    def complete(self) -> bool:
        """Did the answer end (a finish reason), rather than the connection?"""
        return self.finish_reason is not None

    def response(self) -> dict[str, Any]:
        """The chat.completion body a non-streamed request gets, vLLM's layout."""
        message: dict[str, Any] = {"role": "assistant"}
        for name in TEXT_FIELDS:
            if name in self.text:
                message[name] = "".join(self.text[name])
        message.setdefault("content", None)
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }
        if self.token_ids is not None:
            choice["token_ids"] = self.token_ids
        body: dict[str, Any] = {**self.head, "object": "chat.completion", "choices": [choice]}
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
        if self.usage is not None:
            body["usage"] = self.usage
        return body
