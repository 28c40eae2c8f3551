"""Every standard set's format, written small by the tests, read into the same prompts: the
format read from the file when not given, multi-turn sets keeping their turns, and the written
parquet holding to its schema."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from support.eval_sets import (
    write_demo_mt_bench,
    write_gsm8k_parquet,
    write_humaneval_jsonl,
    write_plain_jsonl,
    write_speed_bench_parquet,
)

from eaglenest.demo.tasks import heldout_examples
from eaglenest.formats.eval_sets import read_eval_set
from eaglenest.settings.eval_sets import EvalSetSettings
from eaglenest.stages.eval_sets.eval_sets import prepare_eval_set


def prepared(
    tmp_path: Path, name: str, source: Path, fmt: str = "auto"
) -> tuple[pl.DataFrame, dict]:
    out, report = tmp_path / f"{name}.parquet", tmp_path / f"{name}.report.json"
    prepare_eval_set(EvalSetSettings(name, str(source), fmt), out, report)
    return read_eval_set(str(out)), json.loads(report.read_text())


def test_the_demo_questions_as_mt_bench_keep_their_ids_categories_and_turns(tmp_path):
    frame, report = prepared(tmp_path, "mt_bench", write_demo_mt_bench(tmp_path / "q.jsonl"))
    examples = heldout_examples(0, 6)
    assert report["format"] == "mt_bench" and report["prompts"] == 6
    assert frame["id"].to_list() == [str(n) for n in range(81, 87)]
    assert frame["category"].to_list() == [e.family for e in examples]
    assert [turns[0] for turns in frame["turns"].to_list()] == [e.prompt for e in examples]
    # question 81 and 84 have a second turn: kept, in order
    assert (
        frame.filter(pl.col("id") == "84")["turns"].to_list()[0][1]
        == "Check your answer once more."
    )
    assert report["multi_turn_prompts"] == 2 and report["turns"] == 8
    assert frame["source_row"].to_list() == [1, 2, 3, 4, 5, 6]  # JSON Lines lines, from 1
    assert set(frame["set"]) == {"mt_bench"}


def test_gsm8k_parquet_asks_the_question_and_numbers_the_rows(tmp_path):
    frame, report = prepared(tmp_path, "gsm8k", write_gsm8k_parquet(tmp_path / "test.parquet"))
    assert report["format"] == "gsm8k" and report["categories"] == {"math": 2}
    assert frame["id"].to_list() == ["0", "1"]
    assert frame["turns"].to_list() == [
        ["Tom has 3 apples and buys 4 more. How many?"],
        ["What is 12 * 11?"],
    ]


def test_humaneval_jsonl_asks_the_function_stub_as_is(tmp_path):
    frame, report = prepared(tmp_path, "humaneval", write_humaneval_jsonl(tmp_path / "he.jsonl"))
    assert report["format"] == "humaneval" and report["categories"] == {"coding": 2}
    assert frame["id"].to_list() == ["HumanEval/0", "HumanEval/1"]
    assert frame["turns"].to_list()[0] == ['def add(a, b):\n    """Return a + b."""\n']


def test_speed_bench_parquet_is_told_from_its_columns(tmp_path):
    frame, report = prepared(
        tmp_path, "speed", write_speed_bench_parquet(tmp_path / "test.parquet")
    )
    assert report["format"] == "speed_bench"
    assert frame["turns"].to_list()[1] == ["Summarise: the cat sat.", "Now in French."]
    assert frame["source_row"].to_list() == [0, 1, 2]  # parquet rows, from 0


def test_plain_jsonl_reads_prompt_messages_and_turns(tmp_path):
    frame, report = prepared(tmp_path, "plain", write_plain_jsonl(tmp_path / "p.jsonl"))
    assert report["format"] == "plain" and report["with_system"] == 1
    assert frame["id"].to_list() == ["1", "chat-1", "3"]  # the row's id, else its line
    assert frame["turns"].to_list() == [
        ["Name a prime number."],
        ["Hello?", "And goodbye."],
        ["First.", "Second."],
    ]
    assert frame["system"].to_list() == [None, "Be brief.", None]
    assert frame["category"].to_list() == ["all", "all", "chat"]


def test_a_given_format_overrides_what_the_columns_say(tmp_path):
    # MT-Bench's columns, read as plain: the turns, and the question_id as the id
    frame, report = prepared(
        tmp_path, "as_plain", write_demo_mt_bench(tmp_path / "q.jsonl"), "plain"
    )
    assert report["format"] == "plain" and frame["id"][0] == "81"


@pytest.mark.parametrize("columns", [{"text": "x"}, {"question": "no answer column"}])
def test_an_unknown_layout_is_refused_naming_its_columns_and_the_key(tmp_path, columns):
    from support.eval_sets import write_jsonl

    from eaglenest.stages.eval_sets.files import EvalSetError

    source = write_jsonl(tmp_path / "odd.jsonl", [columns])
    with pytest.raises(EvalSetError) as err:
        prepared(tmp_path, "odd", source)
    message = str(err.value)
    assert f"evaluate.sets 'odd': {source}" in message
    assert "cannot tell the set's format" in message and ", ".join(columns) in message
    assert "`format`" in message
