"""A set is a benchmark: a row that cannot be used fails the set, naming the file, the row (its
line, or its parquet row) and the field, and SPEED-Bench's placeholder rows name the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.eval_sets import SPEED_PLACEHOLDER, write_jsonl, write_speed_bench_parquet

from eaglenest.settings.eval_sets import EvalSetSettings
from eaglenest.stages.eval_sets.eval_sets import prepare_eval_set
from eaglenest.stages.eval_sets.files import EvalSetError


def refusal(tmp_path: Path, source: Path, fmt: str = "auto") -> str:
    out = tmp_path / "out.parquet"
    with pytest.raises(EvalSetError) as err:
        prepare_eval_set(EvalSetSettings("bench", str(source), fmt), out, tmp_path / "r.json")
    assert not out.exists()  # nothing half-written
    return str(err.value)


def test_the_speed_bench_placeholder_row_is_refused_with_the_fix(tmp_path):
    source = write_speed_bench_parquet(tmp_path / "test.parquet", placeholder_row=1)
    message = refusal(tmp_path, source)
    assert f"evaluate.sets 'bench': {source} (read as speed_bench): 1 of 3 rows refused" in message
    assert "row 1: field 'turns[0]': holds SPEED-Bench's placeholder" in message
    assert SPEED_PLACEHOLDER in message
    assert "prepare_data.py --dataset speed --config <config>" in message


def test_the_placeholder_is_refused_whatever_the_format(tmp_path):
    source = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "fine"}, {"prompt": SPEED_PLACEHOLDER.lower()}]
    )
    assert "line 2: field 'prompt': holds SPEED-Bench's placeholder" in refusal(tmp_path, source)


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (
            [{"question_id": 1, "category": "math", "turns": "not a list"}],
            "line 1: field 'turns': expected a non-empty list",
        ),
        (
            [{"question_id": 1, "category": "math", "turns": ["a", " "]}],
            "line 1: field 'turns': turn 2: expected non-empty text",
        ),
        (
            [{"question_id": None, "category": "math", "turns": ["a"]}],
            "line 1: field 'question_id': expected an id",
        ),
        (
            [
                {"question_id": 1, "category": "math", "turns": ["a"]},
                {"question_id": 1, "category": "x", "turns": ["b"]},
            ],
            "line 2: id '1' is already the id of line 1",
        ),
    ],
    ids=["turns-not-a-list", "empty-turn", "no-id", "duplicate-id"],
)
def test_bad_mt_bench_rows_are_refused_naming_line_and_field(tmp_path, rows, expected):
    assert expected in refusal(tmp_path, write_jsonl(tmp_path / "q.jsonl", rows))


def test_bad_messages_are_refused_naming_the_message(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]},
        {"messages": [{"role": "assistant", "content": "only me"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]},
    ]
    message = refusal(tmp_path, write_jsonl(tmp_path / "m.jsonl", rows))
    assert "3 of 3 rows refused" in message
    assert (
        "line 1: field 'messages[1].role': expected user, assistant or a first system, got 'tool'"
        in message
    )
    assert "line 2: field 'messages': no user message" in message
    assert "line 3: field 'messages[1].role'" in message


def test_a_line_that_is_not_json_is_refused_with_its_number(tmp_path):
    source = tmp_path / "q.jsonl"
    source.write_text('{"prompt": "a"}\n\n{"prompt": \n')
    out = tmp_path / "o.parquet"
    with pytest.raises(EvalSetError) as err:
        prepare_eval_set(EvalSetSettings("b", str(source), "auto"), out, tmp_path / "r.json")
    # one line number, the file's (json's own "line 1 column 12" was of the line alone)
    assert str(err.value).endswith(
        "q.jsonl: line 3: not a JSON object: Expecting value (column 12)"
    )


def test_a_file_lacking_its_formats_column_is_refused_naming_both(tmp_path):
    source = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "x"}])
    message = refusal(tmp_path, source, "gsm8k")
    assert "format gsm8k reads column question, which the file lacks (it has prompt)" in message


def test_many_refusals_are_counted_not_all_listed(tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": ""}] * 14)
    message = refusal(tmp_path, source)
    assert "14 of 14 rows refused" in message and "... and 4 more" in message
    assert "line 11:" not in message


def test_a_line_nested_past_the_parsers_limit_is_named_not_a_traceback(tmp_path):
    source = tmp_path / "deep.jsonl"
    source.write_text('{"prompt": "fine"}\n{"prompt": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    assert f"{source}: line 2: nested too deeply" in refusal(tmp_path, source)


def test_a_lone_surrogate_is_refused_naming_the_line_before_the_parquet_write(tmp_path):
    source = tmp_path / "surrogate.jsonl"
    source.write_text('{"prompt": "fine"}\n{"prompt": "half \\ud800 a pair"}\n')
    message = refusal(tmp_path, source)
    assert f"{source}: line 2: holds text that is not valid Unicode" in message


def test_a_line_past_the_bound_is_refused_unread(tmp_path, monkeypatch):
    from eaglenest.stages.eval_sets import files

    monkeypatch.setattr(files, "MAX_LINE_BYTES", 64)
    source = tmp_path / "long.jsonl"
    source.write_text('{"prompt": "fine"}\n{"prompt": "' + "x" * 100 + '"}\n')
    assert f"{source}: line 2: longer than 64 bytes" in refusal(tmp_path, source)


def test_more_rows_than_a_set_may_hold_are_refused(tmp_path, monkeypatch):
    from eaglenest.stages.eval_sets import files

    monkeypatch.setattr(files, "MAX_ROWS", 2)
    source = write_jsonl(tmp_path / "many.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    assert "more than 2 rows, the most a set may hold" in refusal(tmp_path, source)


@pytest.mark.parametrize("rows", [1, 40], ids=["alone", "among-short-rows"])
def test_a_parquet_row_past_the_bound_is_refused_before_the_set_is_loaded(tmp_path, rows):
    """The 4 MiB bound covered JSON Lines only: a parquet set with one 20 MB prompt took 31 s and
    4.8 GB before it was refused. Alone in its row group, the footer refuses it; among short
    rows, its batch does."""
    import polars as pl

    from eaglenest.stages.eval_sets.files import MAX_LINE_BYTES, EvalSetError, read_records

    prompts = ["short"] * (rows - 1) + ["x" * (5 << 20)]
    path = tmp_path / "set.parquet"
    pl.DataFrame({"prompt": prompts}).write_parquet(path)
    with pytest.raises(EvalSetError, match=rf"longer than {MAX_LINE_BYTES:,} bytes"):
        read_records(path)
    pl.DataFrame({"prompt": ["short"] * 3}).write_parquet(path)
    assert [r.values for r in read_records(path)[0]] == [{"prompt": "short"}] * 3
