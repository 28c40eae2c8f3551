"""Streaming for `eaglenest serve`: a chat.completion body cut into the server-sent-event chunks
the real servers send, so a client that assembles them gets exactly the non-streamed body's text.

    dialect  text deltas                       token ids in the stream
    vllm     delta.reasoning, delta.content    prompt_token_ids in the first chunk, then
                                               choices[0].token_ids per chunk
    sglang   delta.reasoning_content, content  none (SGLang does not stream them)
    none     delta.content (inline <think>)    as vllm

One chunk per completion token (as vLLM sends them); the text is spread over the chunks in
proportion, reasoning first, so concatenating the deltas of each field gives the field.
"""

from __future__ import annotations

import json
from typing import Any

from eaglenest.common.reasoning import REASONING_FIELDS


def _spans(total: int, parts: int) -> list[tuple[int, int]]:
    return [(total * i // parts, total * (i + 1) // parts) for i in range(parts)]


def stream_chunks(response: dict[str, Any], *, dialect: str, include_usage: bool) -> list[dict]:
    """The chunks of `response` (a body from `build_response`), the usage chunk last if asked."""
    choice = response["choices"][0]
    message = choice["message"]
    reasoning_field = next((f for f in REASONING_FIELDS if f in message), None)
    reasoning = (message.get(reasoning_field) if reasoning_field else None) or ""
    content = message.get("content") or ""
    ids = choice.get("token_ids") if dialect != "sglang" else None
    n_chunks = max(1, response["usage"]["completion_tokens"])
    head = {
        "id": response["id"],
        "object": "chat.completion.chunk",
        "created": response["created"],
        "model": response["model"],
    }
    first: dict[str, Any] = {
        **head,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    if ids is not None and "prompt_token_ids" in response:
        first["prompt_token_ids"] = response["prompt_token_ids"]
    chunks = [first]
    text = reasoning + content
    id_spans = _spans(len(ids), n_chunks) if ids is not None else None
    for i, (start, end) in enumerate(_spans(len(text), n_chunks)):
        delta: dict[str, Any] = {}
        if start < len(reasoning):
            delta[reasoning_field or "content"] = reasoning[start : min(end, len(reasoning))]
        if end > len(reasoning):
            delta["content"] = content[max(0, start - len(reasoning)) : end - len(reasoning)]
        last = i == n_chunks - 1
        stream_choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": choice["finish_reason"] if last else None,
        }
        if id_spans is not None:
            stream_choice["token_ids"] = ids[id_spans[i][0] : id_spans[i][1]]
        chunks.append({**head, "choices": [stream_choice]})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return chunks


def event(chunk: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = chunk if isinstance(chunk, str) else json.dumps(chunk)
    return f"data: {payload}\n\n".encode()
