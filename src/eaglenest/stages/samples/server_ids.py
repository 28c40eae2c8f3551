"""The server's token ids of a sample: the end of turn it may leave out, the whitespace its
reasoning parser stripped from the text, and where they differ from the rebuild (the report shows
the first mismatches, with their text)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from eaglenest.target_model.encoding import decode_batch

if TYPE_CHECKING:
    from eaglenest.target_model.special_tokens import TargetTokens

MISMATCH_WINDOW = 6  # ids shown on each side of a mismatch

# Reasoning parsers that strip trailing whitespace from the reasoning text, read from vLLM 0.32's
# source: those of its parser engine whose config keeps strip_trailing_reasoning_whitespace (its
# default) on (vllm/parser/*.py; qwen3's turns it off). The model's ids keep the whitespace.
STRIPPING_PARSERS = frozenset({"kimi_k2", "mistral", "nemotron_v3", "step3p5", "inkling"})


def server_text_check(decoded: str, reasoning: str, think_end: str, content: str) -> str | None:
    """How the server's decoded completion ids hold the sample's text: "" when they hold
    `reasoning + think_end + content` as they are, the whitespace W when they hold
    `reasoning + W + think_end + content` (W stripped from the reasoning by the server's reasoning
    parser, e.g. vLLM's kimi_k2: the ids are what the model wrote), None when neither. An answer
    without reasoning (thinking switched off: the prompt closed the think block) holds `content`
    and no `think_end`."""
    if reasoning + think_end + content in decoded:
        return ""
    if not reasoning.strip():
        return "" if content in decoded and think_end not in decoded else None
    pattern = re.escape(reasoning) + r"(\s+)" + re.escape(think_end + content)
    found = re.search(pattern, decoded)
    return found.group(1) if found else None


def server_completion(
    completion_ids: list[int], finish_reason: str | None, tokens: TargetTokens, stop_ids: set[int]
) -> tuple[list[int], bool]:
    """The server's completion ids, with the end-of-turn id appended when the model stopped on it
    but the server left it out (it is a generated token the drafter must learn)."""
    if finish_reason == "stop" and (not completion_ids or completion_ids[-1] not in stop_ids):
        return [*completion_ids, tokens.end_of_turn_id], True
    return list(completion_ids), False


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (length counts), None if equal."""
    if a == b:
        return None
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return min(len(a), len(b))


def describe_mismatch(
    tokenizer: Any,
    sample_id: str,
    server: list[int],
    rebuilt: list[int],
    prompt_len: int,
    same_text: bool,
) -> dict[str, Any]:
    """Where `server` and `rebuilt` first differ, with the ids and text around it; `same_text`:
    whether the whole sequences decode to the same text (another tokenization of it)."""
    position = first_difference(server, rebuilt)
    window = slice(max(0, position - MISMATCH_WINDOW), position + MISMATCH_WINDOW)
    server_ids, rebuilt_ids = server[window], rebuilt[window]
    server_text, rebuilt_text = decode_batch(tokenizer, [server_ids, rebuilt_ids])
    return {
        "id": sample_id,
        "part": "prompt" if position < prompt_len else "completion",
        "position": position,
        "window_start": window.start,
        "server_ids": server_ids,
        "rebuilt_ids": rebuilt_ids,
        "server_text": server_text,
        "rebuilt_text": rebuilt_text,
        "server_len": len(server),
        "rebuilt_len": len(rebuilt),
        "same_text": same_text,
    }
