"""Validation: the empty-reasoning hard stop, drop reasons counted, pandera on real frames."""

import json
from dataclasses import replace

import httpx
import pandera.errors
import polars as pl
import pytest
from support.frames import prompt_frame, raw_row
from support.generation import MODEL, shard_settings

from eaglenest.common.config import settings_from_sections, validate_config
from eaglenest.common.io import read_json, write_json
from eaglenest.demo.server_process import running_server
from eaglenest.formats.raw import RAW_SCHEMA
from eaglenest.settings.samples import ValidationSettings
from eaglenest.settings.target import TargetSettings
from eaglenest.stages.generate.generate import generate_shard
from eaglenest.stages.samples.validate import ShardValidationError, validate_frame, validate_shard
from eaglenest.target_model.tokenizer import target_vocab_size_of

SETTINGS = ValidationSettings(
    max_empty_reasoning_fraction=0.0, max_truncated_fraction=0.1, max_bad_token_ids_fraction=0.0
)
PROBE = {"reasoning_field": "reasoning", "token_ids": {"supported": True}}


def frames(n: int, changes: dict[int, dict]) -> tuple[pl.DataFrame, pl.DataFrame]:
    prompts = prompt_frame(n)
    rows = [raw_row(i, **changes.get(k, {})) for k, i in enumerate(prompts["id"].to_list())]
    return pl.DataFrame(rows, schema=RAW_SCHEMA), prompts


def test_clean_shard_keeps_every_row_and_exact_text():
    raw, prompts = frames(5, {})
    samples, report = validate_frame(raw, prompts, PROBE, SETTINGS, "00000")
    assert samples.height == 5 and report["kept"] == 5 and report["dropped"] == {}
    assert samples["reasoning"].to_list() == ["\nthink\n"] * 5  # whitespace kept
    assert samples["messages"].to_list() == prompts["messages"].to_list()


def test_each_drop_reason_is_counted():
    raw, prompts = frames(
        40,
        {
            0: {"finish_reason": "length"},
            1: {"content": "  "},
            2: {"content": "<think>leak</think> 4"},
            3: {"completion_token_ids": None, "prompt_token_ids": None},
            4: {
                "error_kind": "http_500",
                "error": "boom",
                "response": None,
                "reasoning": None,
                "content": None,
                "reasoning_field": "none",
            },
        },
    )
    samples, report = validate_frame(raw, prompts, PROBE, SETTINGS, "00007")
    assert report["dropped"] == {
        "empty_content": 1,
        "missing_token_ids": 1,
        "request_failed:http_500": 1,
        "think_tag_in_text": 1,
        "truncated": 1,
    }
    assert samples.height == 35 and report["kept"] == 35 and report["answered"] == 39


def test_missing_token_ids_are_fine_when_the_server_gives_none():
    raw, prompts = frames(3, {0: {"completion_token_ids": None, "prompt_token_ids": None}})
    probe = {"token_ids": {"supported": False}}
    samples, _ = validate_frame(raw, prompts, probe, SETTINGS, "00000")
    assert samples.height == 3


def test_too_many_truncations_fail_the_shard():
    raw, prompts = frames(10, {k: {"finish_reason": "length"} for k in range(3)})
    with pytest.raises(ShardValidationError, match=r"shard 00001: 3 of 10 answers hit max_tokens"):
        validate_frame(raw, prompts, PROBE, SETTINGS, "00001")


def test_one_empty_reasoning_stops_the_shard_by_default():
    raw, prompts = frames(10, {3: {"reasoning": " \n", "reasoning_field": "none"}})
    with pytest.raises(ShardValidationError) as err:
        validate_frame(raw, prompts, PROBE, SETTINGS, "00004")
    message = str(err.value)
    assert "shard 00004: 1 of 10 answered rows have empty reasoning" in message
    assert "'reasoning': 9" in message and "'none': 1" in message
    assert "the probe found reasoning in 'reasoning'" in message


def test_raw_file_that_breaks_its_schema_is_named():
    raw, prompts = frames(2, {})
    raw = raw.with_columns(pl.lit(0).cast(pl.Int64).alias("attempts"))
    with pytest.raises(ShardValidationError, match="shard 00002: raw file does not match"):
        validate_frame(raw, prompts, PROBE, SETTINGS, "00002")


def test_a_server_that_drops_reasoning_stops_validation(tmp_path):
    """End to end on the real server: the original bug is caught before any GPU work."""
    prompts_path = tmp_path / "prompts.parquet"
    prompt_frame(30).write_parquet(prompts_path)
    probe = tmp_path / "probe.json"
    write_json(probe, PROBE)
    raw = tmp_path / "raw.parquet"
    with running_server(
        model_name=MODEL, echo=True, faults={"drop_reasoning": 0.2}, fault_seed=1
    ) as url:
        config = validate_config({"target": {"model": MODEL}, "endpoints": [{"url": url}]})
        generate_shard(
            prompts_path, probe, raw, *shard_settings(config), tmp_path / "j.jsonl", shard="00003"
        )
    with pytest.raises(ShardValidationError) as err:
        validate_shard(
            raw,
            prompts_path,
            probe,
            tmp_path / "s.parquet",
            tmp_path / "r.json",
            ValidationSettings.from_config(config),
            "00003",
        )
    assert "shard 00003" in str(err.value) and "empty reasoning" in str(err.value)
    assert not (tmp_path / "s.parquet").exists()

    relaxed = replace(ValidationSettings.from_config(config), max_empty_reasoning_fraction=0.5)
    report = validate_shard(
        raw, prompts_path, probe, tmp_path / "s.parquet", tmp_path / "r.json", relaxed, "00003"
    )
    assert report["dropped"]["empty_reasoning"] == 30 - report["kept"] > 0
    assert read_json(tmp_path / "r.json") == json.loads(json.dumps(report))


# -- token ids: integers in [0, vocab) --------------------------------------------------------

VOCAB = 1000
NOT_INTEGER = 'completion_token_ids[0] is "12", not an integer'


def bad_id_rows() -> dict[int, dict]:
    """Rows 0-3 each with one kind of bad id, as they arrive in a raw file."""
    return {
        # what generate stores for ids that are not integers: no ids, and why
        0: {"prompt_token_ids": None, "completion_token_ids": None, "token_ids_error": NOT_INTEGER},
        1: {"completion_token_ids": [3, VOCAB]},  # out of range
        2: {"completion_token_ids": [3, None, 4]},  # null inside
        3: {"prompt_token_ids": [-1, 2]},  # negative
    }


def test_bad_token_ids_are_dropped_and_counted():
    raw, prompts = frames(10, bad_id_rows())
    settings = replace(SETTINGS, max_bad_token_ids_fraction=0.5)
    samples, report = validate_frame(raw, prompts, PROBE, settings, "00005", vocab_size=VOCAB)
    assert report["dropped"] == {"bad_token_ids": 4}
    assert samples.height == report["kept"] == 6
    ids = raw["id"].to_list()
    assert report["bad_token_ids"] == [
        {"id": ids[0], "problem": NOT_INTEGER},
        {"id": ids[1], "problem": f"completion_token_ids[1] is {VOCAB}, outside [0, {VOCAB})"},
        {"id": ids[2], "problem": "completion_token_ids[1] is null, not an integer"},
        {"id": ids[3], "problem": f"prompt_token_ids[0] is -1, outside [0, {VOCAB})"},
    ]
    assert report["vocab_size"] == VOCAB


def test_without_a_vocabulary_only_negative_and_null_ids_are_bad():
    raw, prompts = frames(10, bad_id_rows())
    settings = replace(SETTINGS, max_bad_token_ids_fraction=0.5)
    _, report = validate_frame(raw, prompts, PROBE, settings, "00005")
    assert report["dropped"] == {"bad_token_ids": 3}  # id 1000 is fine with no bound known


@pytest.mark.parametrize("row", [0, 1, 2])
def test_one_bad_token_id_stops_the_shard_by_default_naming_row_and_value(row):
    raw, prompts = frames(10, {row: bad_id_rows()[row]})
    with pytest.raises(ShardValidationError) as err:
        validate_frame(raw, prompts, PROBE, SETTINGS, "00006", vocab_size=VOCAB)
    message = str(err.value)
    first_bad = {0: '"12"', 1: str(VOCAB), 2: "null"}[row]
    assert message.startswith("shard 00006: 1 of 10 answered rows have bad token ids")
    assert "validation.max_bad_token_ids_fraction 0" in message
    assert f"row {raw['id'][row]}: " in message and f" is {first_bad}, " in message


def test_samples_schema_bounds_ids_by_the_vocabulary():
    from eaglenest.formats.samples import samples_schema

    raw, prompts = frames(2, {})
    samples, _ = validate_frame(raw, prompts, PROBE, SETTINGS, "00000", vocab_size=VOCAB)
    samples_schema(VOCAB).validate(samples)
    too_big = samples.with_columns(pl.lit([1, VOCAB]).alias("completion_token_ids"))
    with pytest.raises(pandera.errors.SchemaError, match="below the target's vocabulary"):
        samples_schema(VOCAB).validate(too_big)
    with_null = samples.with_columns(
        pl.Series("prompt_token_ids", [[1, None], [2]], dtype=pl.List(pl.Int64))
    )
    with pytest.raises(pandera.errors.SchemaError, match="non-null and non-negative"):
        samples_schema(None).validate(with_null)


def target_at(path) -> TargetSettings:
    return settings_from_sections(
        TargetSettings, target={"model": "m", "path": str(path) if path else None}
    )


def test_vocab_size_comes_from_the_targets_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 163840}}))
    assert target_vocab_size_of(target_at(tmp_path)) == 163840
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    assert target_vocab_size_of(target_at(tmp_path)) == 151936
    assert target_vocab_size_of(target_at(None)) is None


def test_vocab_size_falls_back_to_the_tokenizer(tmp_path):
    from eaglenest.demo.target_tokenizer import build_demo_tokenizer

    tokenizer = build_demo_tokenizer(["one two three", "four five"], vocab_size=300)
    tokenizer.save_pretrained(tmp_path)
    assert target_vocab_size_of(target_at(tmp_path)) == len(tokenizer)


def test_a_server_sending_malformed_token_ids_is_caught_by_validation(tmp_path):
    """End to end on the real server: ["12", 7.5, null, -1, 999999] as completion ids neither
    crash generation nor get coerced; validation drops those rows and, by default, stops."""
    prompts_path = tmp_path / "prompts.parquet"
    prompt_frame(30).write_parquet(prompts_path)
    probe = tmp_path / "probe.json"
    write_json(probe, PROBE)
    raw = tmp_path / "raw.parquet"
    with running_server(
        model_name=MODEL, echo=True, faults={"bad_token_ids": 0.2}, fault_seed=1
    ) as url:
        config = validate_config({"target": {"model": MODEL}, "endpoints": [{"url": url}]})
        generate_shard(
            prompts_path, probe, raw, *shard_settings(config), tmp_path / "j.jsonl", shard="00008"
        )
        n_faults = httpx.get(f"{url}/stats").json()["faults"]["bad_token_ids"]
    assert n_faults > 0
    frame = pl.read_parquet(raw)
    marked = frame.filter(pl.col("token_ids_error").is_not_null())
    assert marked.height == n_faults
    assert marked["token_ids_error"].unique().to_list() == [NOT_INTEGER]
    assert marked["completion_token_ids"].is_null().all()
    sent = json.loads(marked["response"][0])["choices"][0]["token_ids"]
    assert sent == ["12", 7.5, None, -1, 999999]  # kept for review exactly as sent

    args = (raw, prompts_path, probe, tmp_path / "s.parquet", tmp_path / "r.json")
    with pytest.raises(ShardValidationError) as err:
        validate_shard(*args, ValidationSettings.from_config(config), "00008", vocab_size=VOCAB)
    assert f"shard 00008: {n_faults} of 30 answered rows have bad token ids" in str(err.value)
    assert f"row {marked['id'][0]}: {NOT_INTEGER}" in str(err.value)
    assert not (tmp_path / "s.parquet").exists()

    relaxed = replace(ValidationSettings.from_config(config), max_bad_token_ids_fraction=0.5)
    report = validate_shard(*args, relaxed, "00008", vocab_size=VOCAB)
    assert report["dropped"] == {"bad_token_ids": n_faults}
    assert report["kept"] == 30 - n_faults
