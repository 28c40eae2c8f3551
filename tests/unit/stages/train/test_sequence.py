"""train.sequence end to end: a tiny drafter of each family trained on synthetic shards
(support/synthetic_run.py) in each mode, the recipe recorded in train_report.json (mode, length,
sink, tokens trained, the largest position trained), a resumed run reporting the whole run's,
and the sliding window refused beside a sink where training reads its settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.synthetic_run import write_synthetic_run

from eaglenest.common.config import settings_from_sections, validate_config
from eaglenest.settings.train import FamilySettings, TrainSettings
from eaglenest.stages.train.train import train_drafter

SIZE = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 8, "vocab_size": 128,
        "draft_vocab_size": 32, "lengths": (20, 90)}  # fmt: skip
LENGTH = 32
SECTION = {"max_steps": 6, "max_batch_tokens": 128, "ttt_steps": 2, "warmup_steps": 0,
           "export_dtype": "float32", "device": "cpu", "checkpoint_every": 2,
           "eval_every": 0}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return write_synthetic_run(tmp_path_factory.mktemp("sequence"), SIZE, samples=16, shards=1)


def trained(
    run: dict, out: Path, sequence: dict, family: str = "eagle3", stop: int | None = None
) -> dict:
    settings = settings_from_sections(
        TrainSettings, train={**SECTION, "sequence": sequence}, target={"path": run["target_path"]}
    )
    config = validate_config(
        {
            "train": {"families": [family], "mask_token_id": 3},
            "target": {"path": run["target_path"]},
        }
    )
    files = {k: run[k] for k in ("train_shards", "eval_shards", "target_head", "draft_vocab")}
    return train_drafter(
        **files,
        out_dir=out / "drafter",
        journal_dir=out / "journal",
        settings=settings,
        family=FamilySettings.from_config(config),
        stop_after_step=stop,
    )


def longest(run: dict) -> int:
    from eaglenest.formats.hidden_shard import open_hidden_shard

    shard = open_hidden_shard(run["train_shards"][0])
    return int((shard.offsets[1:] - shard.offsets[:-1]).max())


@pytest.mark.parametrize("family", ["eagle3", "p_eagle", "dflash"])
@pytest.mark.parametrize("mode", ["whole", "head", "windows"])
def test_each_family_trains_in_each_mode_and_reports_the_recipe(run, tmp_path, family, mode):
    report = trained(run, tmp_path, {"mode": mode, "length": LENGTH}, family)
    assert report["steps"] == SECTION["max_steps"]
    assert report["sequence"]["mode"] == mode and report["sequence"]["length"] == LENGTH
    assert report["sequence"]["sink"] == "prompt"
    assert 0 < report["sequence"]["tokens_trained"] <= report["train_tokens"]
    written = json.loads((tmp_path / "drafter" / "train_report.json").read_text())
    assert written["max_position_trained"] == report["max_position_trained"]
    if mode == "head":
        assert report["max_position_trained"] == LENGTH - 1
    else:  # whole samples, or windows that reach past the head
        assert report["max_position_trained"] > LENGTH - 1
    if mode == "whole":
        assert report["max_position_trained"] <= longest(run) - 1


def test_a_resumed_run_reports_what_the_whole_run_trained(run, tmp_path):
    sequence = {"mode": "windows", "length": LENGTH}
    straight = trained(run, tmp_path / "straight", sequence)
    stopped = trained(run, tmp_path / "resumed", sequence, stop=3)
    assert stopped == {"stopped_at_step": 3}
    resumed = trained(run, tmp_path / "resumed", sequence)
    assert resumed["max_position_trained"] == straight["max_position_trained"]
    assert resumed["sequence"] == straight["sequence"]
    lines = [json.loads(x) for x in (tmp_path / "straight/drafter/metrics.jsonl").open()]
    again = [json.loads(x) for x in (tmp_path / "resumed/drafter/metrics.jsonl").open()]
    assert [r["loss"] for r in lines] == pytest.approx([r["loss"] for r in again])


def test_a_sink_beside_a_sliding_window_is_refused_where_training_reads_it(run, tmp_path):
    settings = settings_from_sections(
        TrainSettings,
        train={**SECTION, "drafter": {"sliding_window": 16}, "sequence": {"sink": 0}},
        target={"path": run["target_path"]},
    )
    sinked = settings.__class__.from_dict(
        {**json.loads(settings.to_json()), "sequence": {"mode": "windows", "length": 32,
                                                         "sink": "prompt"}}
    )  # fmt: skip
    files = {k: run[k] for k in ("train_shards", "eval_shards", "target_head", "draft_vocab")}
    with pytest.raises(ValueError, match=r"sliding_window 16 with train\.sequence\.sink"):
        train_drafter(**files, out_dir=tmp_path / "d", journal_dir=tmp_path / "j", settings=sinked)
