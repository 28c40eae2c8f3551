"""The formats a standard evaluation set comes in, each read into the same prompt: (id, category,
system, turns: the user messages in order). MT-Bench and Spec-Bench JSONL, GSM8K and HumanEval
as the `datasets` library saves them, SPEED-Bench's parquet and plain rows with `prompt`,
`messages` or `turns`. A row that cannot be used raises RowRefused naming its field; `detect`
reads the format from the file's columns."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eaglenest.stages.eval_sets.files import EvalSetError

# SPEED-Bench publishes some sources' prompts as this text (they may not be redistributed); the
# rows are filled by NVIDIA Model-Optimizer's specdec_bench. Matched without its last words.
SPEED_BENCH_PLACEHOLDER = "SHOULD BE FETCHED FROM THE SOURCE"
SPEED_BENCH_FIX = (
    "fetch the full rows once with NVIDIA Model-Optimizer's examples/specdec_bench: `python "
    "prepare_data.py --dataset speed --config <config>` writes data/speed/<config>/test.parquet; "
    "point evaluate.sets at that file (docs/evaluate.md)"
)
# SPEED-Bench's columns beyond MT-Bench's (question_id, category, turns).
SPEED_BENCH_ONLY = ("sub_category", "src_id", "multiturn", "difficulty")


class RowRefused(Exception):
    """One row cannot be used: `field` is the column at fault."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"field {field!r}: {detail}")
        self.field = field


@dataclass(frozen=True)
class Prompt:
    """One prompt of a set, before it gets the set's name and its row."""

    id: str
    category: str
    system: str | None
    turns: list[str]


def _text(row: Mapping[str, Any], field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str) or not value.strip():
        raise RowRefused(field, f"expected non-empty text, got {_shown(value)}")
    _refuse_placeholder(value, field)
    return value


def _identifier(row: Mapping[str, Any], field: str) -> str:
    value = row.get(field)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value).strip() == "":
        raise RowRefused(field, f"expected an id (text or integer), got {_shown(value)}")
    return str(value)


def _turn_list(row: Mapping[str, Any], field: str) -> list[str]:
    value = row.get(field)
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise RowRefused(field, f"expected a non-empty list of user messages, got {_shown(value)}")
    for number, turn in enumerate(value, start=1):
        if not isinstance(turn, str) or not turn.strip():
            raise RowRefused(field, f"turn {number}: expected non-empty text, got {_shown(turn)}")
        _refuse_placeholder(turn, f"{field}[{number - 1}]")
    return list(value)


def _refuse_placeholder(text: str, field: str) -> None:
    if SPEED_BENCH_PLACEHOLDER in text.upper():
        raise RowRefused(
            field,
            f"holds SPEED-Bench's placeholder ({text.strip()!r}), not a prompt; {SPEED_BENCH_FIX}",
        )


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _row_id(row: Mapping[str, Any], source_row: int) -> str:
    for field in ("id", "question_id", "task_id"):
        if row.get(field) is not None:
            return _identifier(row, field)
    return str(source_row)


def mt_bench(row: Mapping[str, Any], source_row: int) -> Prompt:
    """MT-Bench and Spec-Bench `question.jsonl`, SPEED-Bench's parquet: question_id, category,
    turns (all kept: MT-Bench's second turn follows the target's first answer)."""
    return Prompt(
        _identifier(row, "question_id"), _text(row, "category"), None, _turn_list(row, "turns")
    )


def gsm8k(row: Mapping[str, Any], source_row: int) -> Prompt:
    """GSM8K (openai/gsm8k): question (asked), answer (not read); no id: the row's number."""
    return Prompt(_row_id(row, source_row), "math", None, [_text(row, "question")])


def humaneval(row: Mapping[str, Any], source_row: int) -> Prompt:
    """HumanEval (openai/openai_humaneval): task_id, prompt (the function to complete, as is)."""
    return Prompt(_identifier(row, "task_id"), "coding", None, [_text(row, "prompt")])


def plain(row: Mapping[str, Any], source_row: int) -> Prompt:
    """A row with `prompt` (text), `turns` (user messages) or `messages` ({role, content}: the
    user turns kept, a first system turn kept as the system prompt, assistant turns left out as
    the target writes its own); `id`, `category` and `system` when present."""
    category = _text(row, "category") if row.get("category") is not None else "all"
    system = _text(row, "system") if row.get("system") is not None else None
    if row.get("messages") is not None:
        message_system, turns = _messages_turns(row["messages"])
        system = message_system if message_system is not None else system
    elif row.get("turns") is not None:
        turns = _turn_list(row, "turns")
    elif row.get("prompt") is not None:
        turns = [_text(row, "prompt")]
    else:
        raise RowRefused("prompt", "the row has none of prompt, messages or turns")
    return Prompt(_row_id(row, source_row), category, system, turns)


def _messages_turns(messages: Any) -> tuple[str | None, list[str]]:
    if isinstance(messages, str) or not isinstance(messages, Sequence) or not messages:
        raise RowRefused(
            "messages", f"expected a non-empty list of messages, got {_shown(messages)}"
        )
    system, turns = None, []
    for index, message in enumerate(messages):
        field = f"messages[{index}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("content"), str):
            raise RowRefused(
                field, f"expected {{role, content}} with text content, got {_shown(message)}"
            )
        role, content = message.get("role"), message["content"]
        if not content.strip():
            raise RowRefused(f"{field}.content", "empty text")
        _refuse_placeholder(content, f"{field}.content")
        if role == "system" and index == 0:
            system = content
        elif role == "user":
            turns.append(content)
        elif role != "assistant":
            raise RowRefused(
                f"{field}.role", f"expected user, assistant or a first system, got {role!r}"
            )
    if not turns:
        raise RowRefused("messages", "no user message")
    return system, turns


READERS: dict[str, Callable[[Mapping[str, Any], int], Prompt]] = {
    "mt_bench": mt_bench,
    "speed_bench": mt_bench,  # MT-Bench's columns and more; its placeholder refused by every reader
    "gsm8k": gsm8k,
    "humaneval": humaneval,
    "plain": plain,
}
# The columns a format cannot do without (plain: one of prompt, messages, turns).
REQUIRED = {
    "mt_bench": ("question_id", "category", "turns"),
    "speed_bench": ("question_id", "category", "turns"),
    "gsm8k": ("question",),
    "humaneval": ("task_id", "prompt"),
}


def detect(columns: Sequence[str], where: str) -> str:
    """The format of a file with these columns (a JSON Lines file's: its first row's keys)."""
    has = set(columns)
    if {"question_id", "turns"} <= has:
        return "speed_bench" if has & set(SPEED_BENCH_ONLY) else "mt_bench"
    if {"task_id", "prompt"} <= has:
        return "humaneval"
    if {"question", "answer"} <= has:
        return "gsm8k"
    if has & {"prompt", "messages", "turns"}:
        return "plain"
    raise EvalSetError(
        f"{where}: cannot tell the set's format from its columns ({', '.join(columns) or 'none'}): "
        "expected question_id+turns (MT-Bench, Spec-Bench, SPEED-Bench), task_id+prompt "
        "(HumanEval), question+answer (GSM8K) or one of prompt, messages, turns; give the set's "
        "`format` in evaluate.sets"
    )


def check_columns(format_name: str, columns: Sequence[str], where: str) -> None:
    """Refuse a file that lacks a column its format reads, naming it and the file's columns."""
    missing = [c for c in REQUIRED.get(format_name, ()) if c not in columns]
    if format_name == "plain" and not set(columns) & {"prompt", "messages", "turns"}:
        missing = ["one of prompt, messages, turns"]
    if missing:
        raise EvalSetError(
            f"{where}: format {format_name} reads column {', '.join(missing)}, which the file "
            f"lacks (it has {', '.join(columns) or 'no columns'})"
        )
