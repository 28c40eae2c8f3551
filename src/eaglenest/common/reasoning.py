"""Where the reasoning is: field detection and think-tag handling.

Servers disagree on the field name (vLLM: `reasoning`, SGLang and older vLLM: `reasoning_content`,
no parser: `<think>...</think>` inline in `content`). Reading one name silently loses everything
when the server uses another, so every reader goes through `extract_reasoning`, which tries them
all and records which one carried the text. Whitespace is never stripped: the exact text is what
the model produced and what its token ids encode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"
# Order matters: the first non-empty field wins.
REASONING_FIELDS = ("reasoning", "reasoning_content")
INLINE_FIELD = "content_think_tags"
NO_FIELD = "none"


@dataclass(frozen=True)
class ReasoningParts:
    reasoning: str  # "" when no reasoning was found anywhere
    content: str | None
    field: str  # "reasoning", "reasoning_content", "content_think_tags" or "none"


def split_think(
    text: str, start: str = THINK_START, end: str = THINK_END
) -> tuple[str | None, str | None]:
    """Split generated text into (reasoning, content) the way reasoning parsers do.

    The start tag is optional (templates that end the prompt with `<think>` make the model emit
    only the end tag). Without an end tag the whole text is reasoning (generation was cut inside
    the think block), unless it has no start tag either, in which case it is all content.
    """
    body = text.removeprefix(start)
    if end in body:
        reasoning, content = body.split(end, 1)
        return reasoning, content
    if text.startswith(start):
        return body, None
    return None, text


def extract_reasoning(
    message: dict[str, Any], start: str = THINK_START, end: str = THINK_END
) -> ReasoningParts:
    """Read reasoning from a chat-completion `message` whatever field the server used."""
    content = message.get("content")
    for field in REASONING_FIELDS:
        value = message.get(field)
        if isinstance(value, str) and value.strip():
            return ReasoningParts(reasoning=value, content=content, field=field)
    if isinstance(content, str) and end in content:
        reasoning, rest = split_think(content, start, end)
        if reasoning is not None and reasoning.strip():
            return ReasoningParts(reasoning=reasoning, content=rest, field=INLINE_FIELD)
    return ReasoningParts(reasoning="", content=content, field=NO_FIELD)


def present_fields(message: dict[str, Any]) -> dict[str, str]:
    """Describe each field of a message for error reports: 'absent', 'null', 'empty' or 'N chars'."""
    described = {}
    for field in ("content", *REASONING_FIELDS):
        if field not in message:
            described[field] = "absent"
        elif message[field] is None:
            described[field] = "null"
        elif not str(message[field]).strip():
            described[field] = "empty"
        else:
            described[field] = f"{len(str(message[field]))} chars"
    return described
