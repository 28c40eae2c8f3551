"""The probe's reading of a chat-completion response: does it carry token ids, in which layout,
and are they usable (the ids' shape lives in formats/response_ids.py, with the raw shard that
stores them)."""

from __future__ import annotations

from typing import Any

from eaglenest.formats.response_ids import TOKEN_ID_LAYOUTS, extract_token_ids, token_ids_problem


def describe_token_ids(response: dict[str, Any]) -> dict[str, Any]:
    """The probe's summary of token-id support in one response."""
    ids = extract_token_ids(response)
    if ids.layout is None:
        return {"supported": False, "layout": None, "prompt_key": None, "completion_key": None}
    prompt_key, completion_key = TOKEN_ID_LAYOUTS[ids.layout]
    problem = token_ids_problem(ids)
    return {
        # Ids that are not integers are no support: every row would be dropped at validation.
        "supported": problem is None,
        "problem": problem,
        "layout": ids.layout,
        "prompt_key": prompt_key,
        "completion_key": completion_key,
        "n_prompt_tokens": len(ids.prompt or []),
        "n_completion_tokens": len(ids.completion or []),
    }
