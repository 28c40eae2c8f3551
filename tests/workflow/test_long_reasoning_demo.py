"""The long-reasoning demo (config/tests/long-reasoning.yaml) through real Snakemake, made tiny:
a long-task target trained briefly (a few windows of its answers), 8 prompts of the `demo-long`
source, answers of hundreds of tokens, every stage up to the report, and acceptance measured by
depth ([0, 512]) in the evaluation and shown in the report. The full config is run by hand."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from support.workflow import copy_workflow, job_logs, load_test_config, merged, snakemake

pytestmark = [
    pytest.mark.slow,
    # Measured: the long tasks' answers are 900+ tokens by design (demo/long_tasks.py), so at this
    # size's max_tokens 900 every answer is cut inside its think block, which the vLLM dialect
    # (as vLLM's qwen3 parser) returns as content: the probe stops the run. Needs a length scale
    # for the long tasks (answers of a few hundred tokens here) before it can run in the suite.
    pytest.mark.skip(reason="the tiny long demo needs shorter long tasks (see the comment)"),
]

LONG = load_test_config("long-reasoning")
TINY_LONG = {
    **merged(
        LONG,
        {
            "demo_target": {
                "train_steps": 150,
                "batch_size": 16,
                "train_window_tokens": 128,
                "max_position_embeddings": 2048,
                "heldout_prompts": 1,
                "heldout_max_new_tokens": 256,
                "min_reasoning_share": 0,
            },
            "probe": {"max_tokens": 900},
            "prompts": {"max_samples": 8, "shard_size": 4, "demo_pool_size": 40},
            "generation": {"max_tokens": 900},
            # Briefly trained, the target often counts past where it should stop.
            "validation": {"max_truncated_fraction": 1.0},
            "tokenize": {"max_length": 2048},
            "train": {"epochs": 1, "max_batch_tokens": 4096},
            "evaluate": {
                "ks": [3],
                "live_prompts": 2,
                "live_max_new_tokens": 16,
                "depths": [0, 512],
                "engine": None,
            },
        },
    ),
    "run": "long-tiny",
}


def test_the_long_reasoning_demo_runs_every_stage_and_measures_acceptance_by_depth(tmp_path):
    workdir = copy_workflow(tmp_path / "workflow")
    # One torch thread a job (two jobs at once): threads waiting on each other crawl on shared
    # cores, and this run's jobs are many small steps.
    result = snakemake(workdir, "--max-threads", "1", config=TINY_LONG, timeout_s=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + job_logs(workdir)
    results: Path = workdir / "results" / "long-tiny"
    metrics = json.loads((results / "target" / "demo_metrics.json").read_text())
    assert metrics["heldout_prompts"] == 1
    tokens = pl.concat(
        [pl.read_parquet(p) for p in sorted((results / "tokens").glob("0*.parquet"))]
    )
    lengths = tokens["n_tokens"]
    # Answers of hundreds of tokens already (the full config's are of thousands).
    assert lengths.median() >= 300, lengths.to_list()
    sources = pl.concat(
        [pl.read_parquet(p) for p in sorted((results / "prompts").glob("0*.parquet"))]
    )
    assert {s.split(":")[1] for s in sources["source"]} <= {"count_up", "count_down", "copy"}
    evaluation = json.loads((results / "eval" / "metrics.json").read_text())
    table = evaluation["by_depth"]
    assert table["depths"] == [0, 512]
    rows = table["per_k"]["3"]
    assert rows[0]["prompts"] == 2 and rows[0]["live"]["identical_to_greedy"]
    samples = table["samples"]["512"]
    assert samples["prompts"] + samples["too_short"] + samples["prompt_past_depth"] == 4
    deep = rows[1]
    if deep["prompts"]:
        assert deep["live"]["rounds"] > 0 and deep["simulated"]["positions"] > 0
    page = (results / "report" / "index.html").read_text()
    assert "Acceptance by context depth" in page
