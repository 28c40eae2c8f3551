"""The chat-completions wire protocol of `eaglenest serve`: requests, completions, dialects.

A request body is checked into a `ChatRequest` (`parse_chat_request`, raising `RequestError`
with the OpenAI-style message and parameter); a backend answers it with a `Completion`; and
`build_response` writes the chat.completion body in the dialect a real server speaks:

    dialect  reasoning field              token ids (with "return_token_ids": true)
    vllm     message.reasoning            top-level prompt_token_ids, choices[i].token_ids
    vllm_kimi_k2  as vllm, the reasoning's trailing whitespace stripped (vLLM's kimi_k2 parser)
    sglang   message.reasoning_content    choices[i].prompt_token_ids, choices[i].response_token_ids
    none     inline <think>…</think> in message.content; ids as vllm

Completion token ids include the stop token (as vLLM returns them), so prompt ids + completion
ids decode to the rendered prompt followed by exactly what the model generated.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from eaglenest.common.reasoning import split_think

DIALECTS = ("vllm", "vllm_kimi_k2", "sglang", "none")
# Completion "ids" of the bad_token_ids fault: a string, a float, a null, a negative and an id
# beyond any small vocabulary, as a broken server or proxy might send them.
MALFORMED_TOKEN_IDS = ["12", 7.5, None, -1, 999999]


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-style error response."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    model: str | None
    max_tokens: int | None  # None: up to the context length (or the server's default)
    temperature: float | None  # None: the model's default (generation_config), else 1
    top_p: float | None
    seed: int | None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    return_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def _number(body: dict, key: str, *, low: float, high: float | None = None) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{key}' must be a number, got {value!r}", param=key)
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"'{key}' must be {bounds}, got {value!r}", param=key)
    return float(value)


def _integer(body: dict, key: str, *, low: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer, got {value!r}", param=key)
    if low is not None and value < low:
        raise RequestError(f"'{key}' must be >= {low}, got {value!r}", param=key)
    return value


def _message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(
            f"messages[{index}] must be an object with a string 'role'", param="messages"
        )
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        texts = [
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        ]
        message = {**message, "content": "".join(texts)}
    elif content is not None and not isinstance(content, str):
        raise RequestError(
            f"messages[{index}].content must be a string, a list of parts or null",
            param="messages",
        )
    return message


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a chat-completions body; raise RequestError naming the first problem."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    if body.get("n") not in (None, 1):
        raise RequestError("only n=1 is supported", param="n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    max_tokens = _integer(body, "max_completion_tokens", low=1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", low=1)
    seed = _integer(body, "seed")
    return ChatRequest(
        messages=[_message(i, m) for i, m in enumerate(messages)],
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", low=0.0),
        top_p=_number(body, "top_p", low=1e-9, high=1.0),
        seed=None if seed is None else seed % 2**64,  # torch generators take 64-bit seeds
        chat_template_kwargs=kwargs,
        return_token_ids=bool(body.get("return_token_ids")),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
    )


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]  # includes the stop token when finish_reason is "stop"
    text: str  # generated text with special tokens kept, without the final stop token
    finish_reason: str  # "stop" or "length"
    # Seconds a streamed answer is spread over (the echo backend's latency, paid while streaming).
    pace_s: float = 0.0


class Backend(Protocol):
    async def complete(self, request: ChatRequest, *, paced: bool = False) -> Completion: ...

    def waiting(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...


def build_response(
    completion: Completion,
    *,
    model_name: str,
    dialect: str,
    return_token_ids: bool,
    drop_reasoning: bool = False,
    bad_token_ids: bool = False,
) -> dict[str, Any]:
    """The chat.completion body for `completion` in `dialect` (whitespace kept as generated)."""
    reasoning, content = split_think(completion.text)
    if drop_reasoning:
        # The bug this mode reproduces: a normal-looking answer whose reasoning is gone.
        reasoning, content = None, content or ""
    elif dialect == "none":
        reasoning, content = None, completion.text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if dialect == "vllm":
        message["reasoning"] = reasoning
    elif dialect == "vllm_kimi_k2":
        # vLLM 0.32's kimi_k2 parser rstrips the reasoning (strip_trailing_reasoning_whitespace,
        # vllm/parser/engine/parser_engine.py); the token ids keep what the model wrote.
        message["reasoning"] = reasoning.rstrip() if reasoning is not None else None
    elif dialect == "sglang":
        message["reasoning_content"] = reasoning
    message["tool_calls"] = []
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": completion.finish_reason,
    }
    response: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(completion.prompt_token_ids),
            "completion_tokens": len(completion.completion_token_ids),
            "total_tokens": len(completion.prompt_token_ids) + len(completion.completion_token_ids),
        },
    }
    if return_token_ids or bad_token_ids:  # a broken server sends its bad ids unasked too
        completion_ids = MALFORMED_TOKEN_IDS if bad_token_ids else completion.completion_token_ids
        if dialect == "sglang":
            choice["prompt_token_ids"] = completion.prompt_token_ids
            choice["response_token_ids"] = completion_ids
        else:
            response["prompt_token_ids"] = completion.prompt_token_ids
            choice["token_ids"] = completion_ids
    return response
