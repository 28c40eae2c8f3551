"""The token ids of a chat-completion answer, in whichever layout the server uses, and what is
wrong with them: the shape the raw shard stores (formats/raw.py), generation's requests read
(stages/generate/request.py) and the probe summarises (client/responses.py).

vLLM (>= 0.10.2, with `return_token_ids: true`): top-level `prompt_token_ids`, `choices[i].token_ids`.
SGLang: `choices[i].prompt_token_ids` and `choices[i].response_token_ids`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOKEN_ID_LAYOUTS: dict[str, tuple[str, str]] = {
    "vllm": ("prompt_token_ids", "choices[].token_ids"),
    "sglang": ("choices[].prompt_token_ids", "choices[].response_token_ids"),
}


@dataclass(frozen=True)
class TokenIds:
    layout: str | None  # "vllm", "sglang" or None when the response has no ids
    prompt: list[int] | None
    completion: list[int] | None


def _lookup(response: dict[str, Any], key: str) -> Any:
    if key.startswith("choices[]."):
        choices = response.get("choices") or [{}]
        return choices[0].get(key.removeprefix("choices[]."))
    return response.get(key)


def extract_token_ids(response: dict[str, Any]) -> TokenIds:
    for layout, (prompt_key, completion_key) in TOKEN_ID_LAYOUTS.items():
        prompt_ids = _lookup(response, prompt_key)
        completion_ids = _lookup(response, completion_key)
        if isinstance(prompt_ids, list) and isinstance(completion_ids, list) and completion_ids:
            return TokenIds(layout=layout, prompt=prompt_ids, completion=completion_ids)
    return TokenIds(layout=None, prompt=None, completion=None)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def token_ids_problem(ids: TokenIds) -> str | None:
    """What is wrong with the ids' elements as the server sent them (None when every id is a JSON
    integer that fits the raw file's Int64 lists), naming the first bad value and where it is.

    Written into a typed list column, a string or bool id fails the whole shard with a TypeError,
    a float is truncated (7.5 becomes 7) and an int beyond Int64 becomes null, silently; so a row
    with such an id is marked instead. Values are shown as JSON, as the server sent them. The
    range (`[0, vocab)`) is validation's business: it needs the target's vocabulary.
    """
    for name, values in (
        ("prompt_token_ids", ids.prompt),
        ("completion_token_ids", ids.completion),
    ):
        for index, value in enumerate(values or []):
            if isinstance(value, bool) or not isinstance(value, int):
                return f"{name}[{index}] is {json.dumps(value)}, not an integer"
            if not INT64_MIN <= value <= INT64_MAX:
                return f"{name}[{index}] is {value!r}, beyond a 64-bit integer"
    return None
