"""Validation: the empty-reasoning hard stop, drop reasons counted, pandera on real frames."""

import json

import polars as pl
import pytest
from test_generate import MODEL, prompt_frame

from eaglenest.config import validate_config
from eaglenest.generate import RAW_SCHEMA, generate_shard
from eaglenest.io import read_json, write_json
from eaglenest.server_process import running_server
from eaglenest.validate import ShardValidationError, validate_frame, validate_shard

SETTINGS = {"max_empty_reasoning_fraction": 0.0, "max_truncated_fraction": 0.1}
PROBE = {"reasoning_field": "reasoning", "token_ids": {"supported": True}}


def raw_row(sample_id: str, **overrides) -> dict:
    row = dict.fromkeys(RAW_SCHEMA)
    row.update(
        id=sample_id,
        endpoint="http://127.0.0.1:1",
        request="{}",
        response="{}",
        reasoning="\nthink\n",
        content="\n\n42",
        reasoning_field="reasoning",
        finish_reason="stop",
        prompt_token_ids=[1, 2],
        completion_token_ids=[3, 4],
        token_layout="vllm",
        prompt_tokens=2,
        completion_tokens=2,
        latency_s=0.1,
        attempts=1,
    )
    row.update(overrides)
    return row


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
        generate_shard(prompts_path, probe, raw, config, tmp_path / "j.jsonl", shard="00003")
    with pytest.raises(ShardValidationError) as err:
        validate_shard(
            raw,
            prompts_path,
            probe,
            tmp_path / "s.parquet",
            tmp_path / "r.json",
            config["validation"],
            "00003",
        )
    assert "shard 00003" in str(err.value) and "empty reasoning" in str(err.value)
    assert not (tmp_path / "s.parquet").exists()

    relaxed = dict(config["validation"], max_empty_reasoning_fraction=0.5)
    report = validate_shard(
        raw, prompts_path, probe, tmp_path / "s.parquet", tmp_path / "r.json", relaxed, "00003"
    )
    assert report["dropped"]["empty_reasoning"] == 30 - report["kept"] > 0
    assert read_json(tmp_path / "r.json") == json.loads(json.dumps(report))
