"""The samples and vocabulary rules in real Snakemake, on raw shards made here: only the rules
from raw answers on run, and a change of the vocabulary size reruns only the vocabulary (the
vocabulary itself: tests/unit/stages/vocab/test_vocab.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from support.frames import prompt_frame, raw_row
from support.tiny_tokenizer import make_tokenizer
from support.workflow import planned_jobs

from eaglenest.common.io import read_json, write_json
from eaglenest.formats.raw import RAW_SCHEMA
from eaglenest.target_model.tokenizer import think_token_ids

REPO = Path(__file__).resolve().parents[2]


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "snakemake", "--cores", "1", "--configfile=c.yaml"]
    return subprocess.run(
        [*command, *args], cwd=workdir, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.slow
def test_samples_and_vocab_rules_in_snakemake(tmp_path):
    """Only the rules from raw answers on run (prepare_samples: validate + tokenize, then the
    vocabulary), on raw shards made here; changing draft_vocab_size reruns only the vocabulary."""
    for name in ("Snakefile", "rules", "scripts", "config", "profiles", "envs"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, tmp_path / name)
    tokenizer_dir = make_tokenizer(tmp_path / "tokenizer")
    config = {
        "run": "t",
        "target": {"path": str(tokenizer_dir), "chat_template_kwargs": {}},
        "demo_target": {"enabled": False},
        "server": {"enabled": False},
        "endpoints": [{"url": "http://127.0.0.1:9"}],
        "prompts": {"max_samples": 4, "shard_size": 2},
        "tokenize": {"draft_vocab_size": 64},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "results" / "t"
    # A server without token ids: validation keeps the rows and tokenize rebuilds the ids.
    write_json(
        run_dir / "probe.json",
        {
            "reasoning_field": "reasoning",
            "token_ids": {"supported": False},
            "think_token_ids": think_token_ids(str(tokenizer_dir)),  # what the probe writes
        },
    )
    for shard in ("00000", "00001"):
        prompts = prompt_frame(2, tag=shard)
        answers = [
            raw_row(
                i,
                reasoning=f"\nadd {k}\n",
                content=f"\n\n{k}",
                completion_token_ids=None,
                prompt_token_ids=None,
                token_layout=None,
            )
            for k, i in enumerate(prompts["id"].to_list())
        ]
        for stage, frame in (
            ("prompts", prompts),
            ("raw", pl.DataFrame(answers, schema=RAW_SCHEMA)),
        ):
            (run_dir / stage).mkdir(parents=True, exist_ok=True)
            frame.write_parquet(run_dir / stage / f"{shard}.parquet")
    rules = ("--allowed-rules", "prepare_samples", "build_draft_vocab")
    target = "results/t/vocab/draft_vocab.safetensors"
    result = snakemake(tmp_path, target, *rules)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert read_json(run_dir / "samples/00001.report.json")["kept"] == 2
    report = read_json(run_dir / "tokens/00001.report.json")
    assert report["written"] == 2 and report["token_sources"] == {"server": 0, "rebuilt": 2}
    summary = read_json(run_dir / "vocab/draft_vocab.json")
    assert summary["draft_vocab_size"] == 64 and summary["shards"] == 2
    assert summary["coverage"] == 1.0  # 4 short answers use fewer than 64 distinct ids
    # One log per job, each step's lines named by its module.
    log = (tmp_path / "logs/t/prepare_samples/00000.log").read_text()
    assert "eaglenest.stages.samples.validate" in log and "eaglenest.stages.samples" in log
    assert log.count("tokens/s") == 1

    config["tokenize"]["draft_vocab_size"] = 32
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    dry = snakemake(tmp_path, target, *rules, "-n")
    assert planned_jobs(dry) == {"build_draft_vocab": 1}
