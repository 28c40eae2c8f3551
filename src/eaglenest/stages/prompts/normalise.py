"""Normalising one source row to chat `messages`: all turns up to and including the last user turn
(the target regenerates the answer), in the roles system, user and assistant, and its content
hash. A row that cannot be used raises RowSkipped with one of SKIP_REASONS."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eaglenest.settings.prompts import PromptOptions

# Every reason a source row can be skipped; reports list all of them (zeros too) so they diff well.
SKIP_REASONS: tuple[str, ...] = (
    "invalid_json",  # a JSON Lines line that does not parse
    "unknown_schema",  # the row is not an object, or has none of the known/configured columns
    "malformed_turn",  # a turn that is not {role, content} / {from, value} with text content
    "unknown_role",  # a role other than system/user/assistant (or their aliases) before the end
    "non_text_content",  # a content part that is not text (image, audio, ...)
    "no_user_turn",
    "misplaced_system",  # a system turn after another turn: chat templates reject or misplace it
    "empty_text",  # a user or assistant turn with only whitespace
    "too_long",  # more characters than prompts.max_prompt_chars
    "duplicate",  # same messages as an earlier row (same id); the first one in list order wins
)

# Role spellings of the common datasets (ShareGPT uses human/gpt; some dumps use model/bot).
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bot": "assistant",
}


class RowSkipped(Exception):
    """Raised while normalising one row; `reason` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def prompt_id(messages: Sequence[Mapping[str, str]]) -> str:
    """First 16 hex digits of the sha256 of the canonical JSON of `messages` (only role and
    content, keys sorted), so the id depends on the conversation and nothing else."""
    canonical = [{"content": m["content"], "role": m["role"]} for m in messages]
    text = json.dumps(canonical, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class Unparsable:
    """Stands in for a JSON Lines line that does not parse, so it is counted, not fatal."""

    detail: str


def normalise_record(record: Any, options: PromptOptions) -> tuple[list[dict[str, str]], str]:
    """Messages of one source row (system?, user, [assistant, user]...) and the format it was
    read as (`sharegpt`, `messages` or `prompt`); raises RowSkipped when the row is unusable."""
    if isinstance(record, Unparsable):
        raise RowSkipped("invalid_json", record.detail)
    if not isinstance(record, Mapping):
        raise RowSkipped("unknown_schema", f"the row is a {type(record).__name__}, not an object")
    row_format, column = _pick_format(record, options)
    value = record[column]
    if row_format == "prompt" and isinstance(value, str):
        turns = _prompt_turns(record, column, options)
    else:  # a `prompt` column may also hold a list of turns
        if not isinstance(value, (list, tuple)):
            raise RowSkipped(
                "malformed_turn", f"column {column!r} holds a {type(value).__name__}, not turns"
            )
        turns = list(value)
    return _keep_until_last_user(turns, options), row_format


def _pick_format(record: Mapping[str, Any], options: PromptOptions) -> tuple[str, str]:
    columns = options.columns
    candidates = [
        ("sharegpt", columns["conversations"]),
        ("messages", columns["messages"]),
        ("prompt", columns["prompt"]),
        ("prompt", columns["instruction"]),
    ]
    if options.format != "auto":
        candidates = [c for c in candidates if c[0] == options.format]
    for row_format, column in candidates:
        # Tables (parquet, datasets) give every column to every row, null where absent.
        if record.get(column) is not None:
            return row_format, column
    wanted = ", ".join(column for _, column in candidates)
    present = ", ".join(sorted(map(str, record))) or "none"
    raise RowSkipped(
        "unknown_schema",
        f"no column of format {options.format} ({wanted}); the row has: {present}",
    )


def _prompt_turns(
    record: Mapping[str, Any], column: str, options: PromptOptions
) -> list[dict[str, Any]]:
    columns = options.columns
    text = record[column]
    extra = record.get(columns["input"]) if column == columns["instruction"] else None
    if isinstance(extra, str) and extra.strip():
        text = f"{text}\n\n{extra}"  # the Alpaca convention for instruction + input
    turns: list[dict[str, Any]] = []
    system = record.get(columns["system"])
    if isinstance(system, str):
        turns.append({"role": "system", "content": system})
    turns.append({"role": "user", "content": text})
    return turns


def _turn_role(turn: Any) -> str | None:
    """Canonical role of a {role, content} or {from, value} turn; None when unknown."""
    if not isinstance(turn, Mapping):
        return None
    role = turn.get("role") if turn.get("role") is not None else turn.get("from")
    return ROLE_ALIASES.get(role.strip().lower()) if isinstance(role, str) else None


def _turn_text(turn: Mapping[str, Any], position: int) -> str:
    content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # OpenAI content parts
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                if not isinstance(part.get("text"), str):
                    raise RowSkipped("malformed_turn", f"turn {position} has a text part no text")
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RowSkipped("non_text_content", f"turn {position} has a {kind} part")
        return "\n".join(texts)  # vLLM joins text parts with a newline too
    raise RowSkipped("malformed_turn", f"turn {position} has no text content")


def _keep_until_last_user(turns: list[Any], options: PromptOptions) -> list[dict[str, str]]:
    roles = [_turn_role(turn) for turn in turns]
    if "user" not in roles:
        raise RowSkipped("no_user_turn", f"{len(turns)} turns, none from the user")
    last_user = len(roles) - 1 - roles[::-1].index("user")
    # Intermediate assistant turns stay: they are the context the last user turn refers to.
    messages: list[dict[str, str]] = []
    for position, (turn, role) in enumerate(zip(turns[: last_user + 1], roles)):
        if role is None:
            if not isinstance(turn, Mapping):
                raise RowSkipped("malformed_turn", f"turn {position} is not an object")
            raw = turn.get("role") if turn.get("role") is not None else turn.get("from")
            reason = "unknown_role" if raw is not None else "malformed_turn"
            raise RowSkipped(reason, f"turn {position} has role {raw!r}")
        text = _turn_text(turn, position)
        if role == "system":
            if not options.keep_system or not text.strip():
                continue  # an empty system prompt is the same as none
            if messages:
                raise RowSkipped("misplaced_system", f"turn {position} is a system turn")
        elif not text.strip():
            raise RowSkipped("empty_text", f"turn {position} ({role}) is empty")
        messages.append({"role": role, "content": text})
    n_chars = sum(len(m["content"]) for m in messages)
    if options.max_prompt_chars is not None and n_chars > options.max_prompt_chars:
        raise RowSkipped(
            "too_long",
            f"{n_chars} characters > prompts.max_prompt_chars {options.max_prompt_chars}",
        )
    return messages
