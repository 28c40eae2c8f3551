"""The thinking mode recorded per sample: validation writes the switch each request sent and
whether its answer reasoned (samples' `thinking_switch`, `thinking`, and a summary in the
report), tokenize carries it to the tokens (`thinking`, and its report), and a samples shard
written before the mode was recorded gets it from its requests (thinking off:
test_thinking_off_samples.py)."""

import json

import polars as pl
import pytest
from support.frames import prompt_frame, raw_row, sample, samples_frame
from support.tiny_tokenizer import make_tokenizer

from eaglenest.common.config import validate_config
from eaglenest.formats.raw import RAW_SCHEMA
from eaglenest.formats.samples import THINKING_COLUMNS
from eaglenest.formats.tokens import read_thinking
from eaglenest.settings.probe import ProbeSettings
from eaglenest.settings.samples import TokenizeSettings, ValidationSettings
from eaglenest.stages.probe import probe_think_ids
from eaglenest.stages.samples.tokenize import tokenize_samples
from eaglenest.stages.samples.validate import validate_frame

PROBE = {"reasoning_field": "reasoning", "token_ids": {"supported": True}}
STRICT = ValidationSettings(
    max_empty_reasoning_fraction=0.0, max_truncated_fraction=0.1, max_bad_token_ids_fraction=0.0
)


def request(kwargs: dict | None) -> str:
    body = {"messages": [], "model": "m"}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    return json.dumps(body, sort_keys=True)


def raw_frame(kwargs: list[dict | None], **changes) -> tuple[pl.DataFrame, pl.DataFrame]:
    prompts = prompt_frame(len(kwargs))
    rows = [
        raw_row(i, request=request(k), **changes) for i, k in zip(prompts["id"].to_list(), kwargs)
    ]
    return pl.DataFrame(rows, schema=RAW_SCHEMA), prompts


def test_samples_record_the_switch_sent_and_that_reasoning_came_back():
    raw, prompts = raw_frame([{"enable_thinking": True}, {"thinking": True}, None])
    samples, report = validate_frame(raw, prompts, PROBE, STRICT, "00000")
    assert samples["thinking_switch"].to_list() == [True, True, None]
    assert samples["thinking"].to_list() == [True, True, True]
    assert report["thinking"] == {
        "mode": "on",
        "samples": {"on": 3},
        "switch_sent": {"none": 1, "true": 2},
    }


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    tokenizer_dir = make_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return validate_config(
        {"target": {"path": str(tokenizer_dir), "chat_template_kwargs": {"enable_thinking": True}}}
    )


def tokenize(samples: pl.DataFrame, config: dict):
    think_ids = probe_think_ids(ProbeSettings.from_config(config))
    return tokenize_samples(samples, TokenizeSettings.from_config(config), think_ids)


def test_tokens_carry_the_mode_and_an_old_samples_shard_gets_it(config, tmp_path):
    rows = [
        sample(f"q{i}", "\nadd them\n", f" {i}", kwargs={"enable_thinking": True}) for i in (1, 2)
    ]
    old = samples_frame(rows).drop(*THINKING_COLUMNS)  # written before the mode was recorded
    frame, _, report = tokenize(old, config)
    assert frame["thinking"].to_list() == [True, True]
    assert report["thinking"] == {"mode": "on", "samples": {"on": 2}}
    # A tokens shard without the column reads as unknown, sample by sample.
    frame.write_parquet(tmp_path / "new.parquet")
    frame.drop("thinking").write_parquet(tmp_path / "old.parquet")
    paths = [tmp_path / "new.parquet", tmp_path / "old.parquet"]
    assert read_thinking(paths) == [True, True, None, None]
