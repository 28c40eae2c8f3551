"""`evaluate.sets` in the config: entries checked by the schema and by the config check (unique
names, files present, known suffixes), every error naming the key and the entry."""

from __future__ import annotations

import copy
import os

import pytest

from eaglenest.common.config import ConfigError, validate_config
from eaglenest.settings.eval_sets import EvalSetSettings, eval_set_names, eval_set_settings


def config_with(sets: list) -> dict:
    return validate_config({"evaluate": {"sets": copy.deepcopy(sets)}})


@pytest.fixture
def in_tmp(tmp_path):
    here = os.getcwd()
    os.chdir(tmp_path)  # paths are relative to the working directory, where Snakemake runs
    (tmp_path / "sets").mkdir()
    (tmp_path / "sets" / "mt.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "sets" / "gsm8k.parquet").write_bytes(b"")
    yield tmp_path
    os.chdir(here)


def test_entries_get_their_default_format_and_round_trip(in_tmp):
    config = config_with(
        [
            {"name": "mt", "path": "sets/mt.jsonl"},
            {"name": "g", "path": "sets/gsm8k.parquet", "format": "gsm8k"},
        ]
    )
    assert eval_set_names(config) == ["mt", "g"]
    settings = eval_set_settings(config, "mt")
    assert settings == EvalSetSettings("mt", "sets/mt.jsonl", "auto")
    assert EvalSetSettings.from_json(settings.to_json()) == settings
    assert eval_set_names(validate_config({})) == []


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (
            [{"name": "mt", "path": "sets/mt.jsonl"}, {"name": "mt", "path": "sets/gsm8k.parquet"}],
            "config key 'evaluate.sets[1]' (set 'mt'): the name is already used by evaluate.sets[0]",
        ),
        (
            [{"name": "gone", "path": "sets/none.jsonl"}],
            "config key 'evaluate.sets[0]' (set 'gone'): file not found: sets/none.jsonl",
        ),
        (
            [{"name": "csv", "path": "sets/mt.jsonl"}, {"name": "c", "path": "sets"}],
            "config key 'evaluate.sets[1]' (set 'c'): file not found",
        ),
        (
            [{"name": "mt", "path": "sets/mt.jsonl", "format": "alpaca"}],
            "config key 'evaluate.sets.0.format'",
        ),
        ([{"name": "a b", "path": "sets/mt.jsonl"}], "config key 'evaluate.sets.0.name'"),
        ([{"name": "mt"}], "config section 'evaluate.sets.0' is missing a required key"),
    ],
    ids=["duplicate-name", "missing-file", "directory", "unknown-format", "bad-name", "no-path"],
)
def test_bad_entries_are_refused_naming_key_and_entry(in_tmp, sets, expected):
    with pytest.raises(ConfigError) as err:
        config_with(sets)
    assert expected in str(err.value)


def test_an_unknown_suffix_is_refused(in_tmp):
    (in_tmp / "sets" / "mt.csv").write_text("prompt\nx\n")
    with pytest.raises(
        ConfigError,
        match=r"'evaluate.sets\[0\]' \(set 'c'\): sets/mt.csv is not one of .jsonl, .parquet",
    ):
        config_with([{"name": "c", "path": "sets/mt.csv"}])


def test_the_missing_file_message_says_where_it_looked(in_tmp):
    with pytest.raises(ConfigError) as err:
        config_with([{"name": "gone", "path": "sets/none.jsonl"}])
    assert str(in_tmp.resolve() / "sets" / "none.jsonl") in str(err.value)
    assert "never downloaded at run time" in str(err.value)


def test_an_eval_set_path_that_loops_is_named_not_a_traceback(tmp_path):
    from eaglenest.settings.eval_sets import check_eval_sets

    (tmp_path / "a.jsonl").symlink_to(tmp_path / "b.jsonl")
    (tmp_path / "b.jsonl").symlink_to(tmp_path / "a.jsonl")
    config = {"evaluate": {"sets": [{"name": "loop", "path": "a.jsonl"}]}}
    with pytest.raises(ValueError, match=r"'evaluate.sets\[0\]' \(set 'loop'\): a.jsonl is a sym"):
        check_eval_sets(config, tmp_path)


def test_a_set_or_compared_name_past_64_characters_is_refused_by_key(in_tmp):
    """A 281-character set name was "File name too long" inside Snakemake (it names a file)."""
    (in_tmp / "s.jsonl").write_text('{"prompt": "p"}\n')
    with pytest.raises(ConfigError, match=r"evaluate.sets.0.name': '(x){281}' is too long"):
        config_with([{"name": "x" * 281, "path": "s.jsonl"}])
    with pytest.raises(ConfigError, match=r"evaluate.compare': '(y){281}' is too long"):
        validate_config({"evaluate": {"compare": {"y" * 281: str(in_tmp)}}})
