"""Real Snakemake in a temp dir on a small demo config: the pipeline runs end to end (demo target,
embedded server, probe, prompts, generation, validation, tokens, hidden states, training,
evaluation, report) and a rerun does nothing; what a change reruns is in test_incremental.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import polars as pl
import pytest

# Shared with other workflow tests; `finished_run` is a session fixture in conftest.py.
from workflow_helpers import SMALL_DEMO, merged, planned_jobs, snakemake

pytestmark = pytest.mark.slow


def test_demo_pipeline_runs_end_to_end(finished_run: Path):
    run = finished_run / "results" / "demo"
    probe = json.loads((run / "probe.json").read_text())
    assert probe["reasoning_field"] == "reasoning"
    assert probe["token_ids"] == {"supported": True, "layout": "vllm"}
    assert probe["think_token_ids"]["source"] == "tokenizer"
    for shard in ("00000", "00001"):
        prompts = pl.read_parquet(run / "prompts" / f"{shard}.parquet")
        samples = pl.read_parquet(run / "samples" / f"{shard}.parquet")
        report = json.loads((run / "samples" / f"{shard}.report.json").read_text())
        assert prompts.height == 20
        assert samples.height == report["kept"] > 0
        assert set(samples["id"]) <= set(prompts["id"])
        assert all(r.strip() for r in samples["reasoning"].to_list())
        assert samples["reasoning_field"].unique().to_list() == ["reasoning"]
        assert samples["completion_token_ids"].null_count() == 0
    # Logs per job, the server's beside the job that started it (and it is gone now).
    logs = finished_run / "logs" / "demo"
    assert (logs / "build_demo_target.log").read_text()
    assert "listening on http://127.0.0.1" in (logs / "generate" / "00000.server.log").read_text()
    assert subprocess.run(["pgrep", "-f", "eaglenest.cli serve"], check=False).returncode == 1


def test_nothing_to_do_after_a_finished_run(finished_run: Path):
    assert planned_jobs(snakemake(finished_run, "-n", config=SMALL_DEMO)) == {}


def test_dict_param_key_order_reruns_nothing(finished_run: Path):
    config = json.loads(json.dumps(SMALL_DEMO))
    config["generation"] = dict(reversed(list(config["generation"].items())))
    config["demo_target"] = dict(reversed(list(config["demo_target"].items())))
    assert planned_jobs(snakemake(finished_run, "-n", config=config)) == {}


def test_client_settings_rerun_nothing(finished_run: Path):
    config = merged(SMALL_DEMO, {"generation": {"concurrency": 7, "timeout_s": 30}})
    assert planned_jobs(snakemake(finished_run, "-n", config=config)) == {}
