"""The example configs of real targets (config/examples/) in the stages, without Snakemake: the
Kimi-K2.5 disk figures of docs/real-targets.md are the hidden-state stage's own arithmetic, and
rows shaped as mlabonne/open-perfectblend's go through the prompts stage with the examples'
settings. Their runs as Snakemake plans them: tests/workflow/test_examples.py."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from support.kimi_shape import KIMI_K25_TEXT, write_kimi_config, write_tokens
from support.workflow import REPO

from eaglenest.common.config import validate_config
from eaglenest.formats.hidden_shard import bytes_per_token, tensor_specs
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.prompts import PromptOptions
from eaglenest.stages.hidden_states.plan import plan_hidden_shard
from eaglenest.stages.prompts.prompts import prepare_prompts
from eaglenest.target_model.loading import load_text_config

EXAMPLES = REPO / "config" / "examples"
DATASET = "mlabonne/open-perfectblend"
# The examples tests/workflow/test_examples.py plans (its EXPECTED).
EXAMPLE_NAMES = ("kimi-k2.5", "qwen3-8b")


def example_config(name: str) -> dict:
    """The example over the schema's defaults, validated: what the workflow runs it with."""
    return validate_config(yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()))


def test_kimi_hidden_state_disk_is_what_the_readme_says(tmp_path, caplog):
    """docs/real-targets.md, Disk: with the example's fp8 aux and top-1 signal, B = n aux x 7168 x 1
    (fp8) + n x 4 (their scales) + 4 + 4 (top-1 id and value) + 8 (input_ids) + 1 (loss_mask) bytes
    a token, against the anchors' 4 x 7168 x 2 and bf16's 57,353, for 10,000 samples of 16,384
    tokens. The hidden stage's own size line, planned from a config.json of Kimi-K2.5's nesting and
    sizes (text_config: 61 layers), must say the same: the example as it is (eagle3 and dflash: the
    union of vLLM's (2, 30, 58) and z-lab's five, seven layers) and with eagle3 alone (three)."""
    readme = (REPO / "docs" / "real-targets.md").read_text()
    config = example_config("kimi-k2.5")
    assert config["train"]["families"] == ["eagle3", "dflash"]
    target = write_kimi_config(tmp_path / "kimi-k2.5", KIMI_K25_TEXT)
    tokens = write_tokens(tmp_path / "tokens.parquet", [16_384, 100])
    eagle3_only = {**config, "train": {**config["train"], "families": ["eagle3"]}}
    cases = (
        (config, (2, 16, 30, 31, 45, 58, 59), 50_221),
        (eagle3_only, (2, 30, 58), 21_533),
    )
    for each, layers, expected in cases:
        settings = HiddenSettings.from_config(each)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="eaglenest.stages.hidden_states.plan"):
            plan = plan_hidden_shard(tokens, load_text_config(target), settings)
        assert (plan.layer_ids, plan.hidden_size) == (layers, 7168)
        per_token = bytes_per_token(plan.specs)
        assert per_token == len(layers) * (7168 + 4) + 4 + 4 + 8 + 1 == expected
        assert f"({per_token} bytes/token)" in caplog.text
        assert f"{per_token:,}" in readme
        assert f"{10_000 * 16_384 * per_token / 1e12:.1f} TB" in readme
    anchors = 4 * 7168 * 2
    assert f"{anchors:,}" in readme and f"{21_533 / anchors:.2f}" in readme
    bf16 = replace(settings, dtype="bf16", target_signal="final_hidden")
    assert bytes_per_token(tensor_specs(1, 1, 7168, 3, bf16)) == 57_353
    # With dflash's default layers, the union of seven (tests/unit/settings/test_target_layers.py)
    union = bytes_per_token(tensor_specs(1, 1, 7168, 7, settings))
    assert union == 7 * 7168 + 7 * 4 + 4 + 4 + 8 + 1 == 50_221 and f"{union:,}" in readme
    assert f"{10_000 * 16_384 * union / 1e12:.1f} TB" in readme
    assert "57,353" in readme and f"{10_000 * 16_384 * 57_353 / 1e12:.1f} TB" in readme


def perfectblend_row(source: str, *turns: tuple[str, str]) -> dict:
    return {"conversations": [{"from": f, "value": v} for f, v in turns], "source": source}


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_open_perfectblend_rows_become_prompts(name, tmp_path):
    """Rows shaped as mlabonne/open-perfectblend's (a `conversations` column of ShareGPT turns
    and a `source` column, in data/train-*.parquet) through the dataset path of the prompts stage,
    with the example's prompt settings; a local directory stands in for the hub name."""
    rows = [
        perfectblend_row(
            "slimorca",
            ("system", "You are helpful."),
            ("human", "Name a prime."),
            ("gpt", "7"),
            ("human", "Another?"),
            ("gpt", "11"),
        ),
        perfectblend_row("metamath", ("human", "What is 2 + 2?"), ("gpt", "4")),
        perfectblend_row("metamath", ("human", "What is 2 + 2?"), ("gpt", "Four.")),
        perfectblend_row("code", ("human", "x" * 16_001), ("gpt", "too long")),
    ]
    dataset = tmp_path / "open-perfectblend"
    (dataset / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), dataset / "data" / "train-00000-of-00001.parquet")
    options = PromptOptions.from_config(example_config(name))
    assert (options.source, options.format) == (DATASET, "sharegpt")
    options = dataclasses.replace(
        options, source=str(dataset), cache_dir=str(tmp_path / "hf"), max_samples=2
    )
    report = prepare_prompts(options, tmp_path / "all.parquet", tmp_path / "report.json")
    messages = sorted(pl.read_parquet(tmp_path / "all.parquet")["messages"].to_list(), key=len)
    assert messages == [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Another?"},
        ],
    ]
    skipped = {reason: n for reason, n in report["skipped"].items() if n}
    assert skipped == {"duplicate": 1, "too_long": 1}  # same prompt, other answer; > 16,000 chars
