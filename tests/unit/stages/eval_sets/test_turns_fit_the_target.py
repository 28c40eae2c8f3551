"""A set whose prompt exceeds the target's context is refused when the set is prepared, before any
training job, naming set, row and lengths (it was found at evaluation, in vLLM's words); the limit
is the target's max_position_embeddings, or vllm.max_model_len where the user fixed it, and the
turns are measured as the evaluation renders them (later turns after the earlier answers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.eval_sets import write_jsonl
from support.tiny_tokenizer import make_tokenizer

from eaglenest.settings.eval_sets import EvalSetLimits, EvalSetSettings
from eaglenest.settings.target import TargetSettings
from eaglenest.stages.eval_sets.eval_sets import prepare_eval_set
from eaglenest.stages.eval_sets.files import EvalSetError
from eaglenest.target_model.set_turns import ANSWER_SLACK, rendered_turns
from eaglenest.target_model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A target directory: the tiny tokenizer and a config.json of 256 positions."""
    directory = make_tokenizer(tmp_path_factory.mktemp("target"))
    config = {"model_type": "qwen3", "max_position_embeddings": 256}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def limits(target: Path, max_new_tokens: int = 64, max_model_len: int | None = None):
    view = TargetSettings(
        model="t",
        path=str(target),
        tokenizer=None,
        trust_remote_code=False,
        chat_template_kwargs={},
        think_tokens={},
        reasoning_parser=None,
    )
    return EvalSetLimits(max_new_tokens, max_model_len, view)


def prepare(tmp_path: Path, rows: list[dict], set_limits: EvalSetLimits) -> Path:
    source = write_jsonl(tmp_path / "set.jsonl", rows)
    out = tmp_path / "set.parquet"
    prepare_eval_set(
        EvalSetSettings("s", str(source), "auto"), out, tmp_path / "r.json", set_limits
    )
    return out


def test_a_prompt_past_the_targets_positions_is_refused_naming_row_and_lengths(target, tmp_path):
    rows = [{"prompt": "What is 2 + 2?"}, {"prompt": "What is 2 + 2? " * 80}]
    with pytest.raises(EvalSetError) as err:
        prepare(tmp_path, rows, limits(target))
    message = str(err.value)
    assert (
        "evaluate.sets 's': " in message and "1 of 2 rows do not fit the 256 positions" in message
    )
    assert "the target's max_position_embeddings" in message
    assert "line 2: its longest turn's prompt is " in message and "with 64 to generate" in message
    assert not (tmp_path / "set.parquet").exists()  # nothing written


def test_a_later_turn_counts_the_earlier_answers(target, tmp_path):
    """Two short turns fit alone, not with an answer of 200 tokens between them."""
    rows = [{"turns": ["What is 2 + 2?", "And 3 + 3?"]}]
    prepare(tmp_path, rows, limits(target, max_new_tokens=40))  # fits
    with pytest.raises(EvalSetError, match="line 1: its longest turn's prompt is"):
        prepare(tmp_path, rows, limits(target, max_new_tokens=200))


def test_the_users_max_model_len_is_the_limit_when_set(target, tmp_path):
    rows = [{"prompt": "What is 2 + 2?"}]
    prepare(tmp_path, rows, limits(target, max_model_len=None))
    with pytest.raises(EvalSetError, match="do not fit the 70 positions of vllm.max_model_len"):
        prepare(tmp_path, rows, limits(target, max_model_len=70))


def test_the_measure_is_the_one_the_evaluation_sizes_its_engine_with(target):
    """rendered_turns is shared with stages/evaluate/sets.py: a later turn is the whole chat
    rendered plus each earlier answer's budget and slack."""
    tokenizer = load_tokenizer(limits(target).target)
    row = {"system": None, "turns": ["What is 2 + 2?", "And 3 + 3?"]}
    ((first, longest),) = rendered_turns(tokenizer, [row], {}, 10)
    whole = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert (
        longest == len(tokenizer(whole, add_special_tokens=False)["input_ids"]) + 10 + ANSWER_SLACK
        and len(first) < longest
    )
