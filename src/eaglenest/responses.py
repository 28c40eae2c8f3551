"""Reading chat-completion responses: token ids in whichever layout the server uses.

vLLM (>= 0.10.2, with `return_token_ids: true`): top-level `prompt_token_ids`, `choices[i].token_ids`.
SGLang: `choices[i].prompt_token_ids` and `choices[i].response_token_ids`.
"""

from __future__ import annotations

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


def describe_token_ids(response: dict[str, Any]) -> dict[str, Any]:
    """The probe's summary of token-id support in one response."""
    ids = extract_token_ids(response)
    if ids.layout is None:
        return {"supported": False, "layout": None, "prompt_key": None, "completion_key": None}
    prompt_key, completion_key = TOKEN_ID_LAYOUTS[ids.layout]
    return {
        "supported": True,
        "layout": ids.layout,
        "prompt_key": prompt_key,
        "completion_key": completion_key,
        "n_prompt_tokens": len(ids.prompt or []),
        "n_completion_tokens": len(ids.completion or []),
    }
