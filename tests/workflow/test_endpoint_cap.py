"""One cap per endpoint over every shard job, through real Snakemake against the real echo server
(which counts the requests it handles at once): 2 and 4 shard jobs at once never exceed the cap;
a kill -9 of the whole run, `--unlock` and a rerun answer every prompt once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import polars as pl
import pytest
from support.workflow import (
    DEMO_CONFIGFILE,
    SMALL_DEMO,
    SMALL_RUN,
    copy_workflow_with_target,
    job_logs,
    merged,
    snakemake,
)

from eaglenest.client.journal import iter_journal
from eaglenest.demo.server_process import running_server

pytestmark = pytest.mark.slow

CAP = 4
SHARDS = ("00000", "00001", "00002", "00003")
RAW = tuple(f"results/{SMALL_RUN}/raw/{shard}.parquet" for shard in SHARDS)
MODEL = "demo-qwen3"  # config/config.yaml's target.model, which the echo server answers as


def external_server_config(url: str, slots_dir: Path) -> dict:
    """SMALL_DEMO against one external endpoint capped at CAP, each job asking for twice that:
    without a cap over jobs, one job alone would exceed it."""
    config = merged(
        SMALL_DEMO,
        {
            "server": {"enabled": False},
            "prompts": {"max_samples": 40, "shard_size": 10},
            "generation": {"concurrency": 2 * CAP, "slots_dir": str(slots_dir), "activity_s": 0.5},
        },
    )
    config["endpoints"] = [{"url": url, "max_concurrency": CAP}]
    return config


def busiest_overlap(workdir: Path) -> int:
    """The most shard jobs that were generating at the same moment (from their activity files)."""
    spans = []
    for shard in SHARDS:
        path = workdir / f"logs/{SMALL_RUN}/generate_responses/{shard}.activity.json"
        activity = json.loads(path.read_text())
        spans.append((activity["started_at"], activity["finished_at"]))
    return max(sum(start <= t < end for start, end in spans) for t, _ in spans)


@pytest.mark.parametrize("jobs", [2, 4])
def test_shard_jobs_at_once_never_exceed_the_endpoint_cap(
    jobs: int, demo_target_dir: Path, tmp_path: Path
):
    workdir = copy_workflow_with_target(tmp_path / "run", demo_target_dir)
    with running_server(
        model_name=MODEL, echo=True, echo_latency_s=0.5, echo_latency_sigma=0.5
    ) as url:
        config = external_server_config(url, tmp_path / "slots")
        result = snakemake(workdir, *RAW, config=config, cores=jobs)
        stats = httpx.get(f"{url}/stats", timeout=5).json()
    assert result.returncode == 0, result.stderr[-4000:] + job_logs(workdir)
    assert stats["max_in_flight"] == CAP, stats  # reached, never passed
    assert busiest_overlap(workdir) >= 2, "shard jobs ran one after another"
    for path in RAW:
        raw = pl.read_parquet(workdir / path)
        assert raw.height == 10 and raw["error_kind"].null_count() == 10
    log = (workdir / f"logs/{SMALL_RUN}/generate_responses/00000.log").read_text()
    assert f"of {CAP} slots in flight" in log and "busy slot-seconds" in log


def test_kill_9_unlock_and_rerun_answer_every_prompt_once(demo_target_dir: Path, tmp_path: Path):
    workdir = copy_workflow_with_target(tmp_path / "run", demo_target_dir)
    journals = [workdir / f"results/{SMALL_RUN}/journal/generate/{shard}.jsonl" for shard in SHARDS]
    with running_server(model_name=MODEL, echo=True, echo_latency_s=0.4) as url:
        config = external_server_config(url, tmp_path / "slots")
        (workdir / "override.yaml").write_text(json.dumps(config))
        # Targets before --configfile, which takes every file name after it.
        command = [sys.executable, "-m", "snakemake", "--cores", "4", *RAW]
        run = subprocess.Popen(
            [*command, "--configfile", DEMO_CONFIGFILE, "override.yaml"],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: the kill takes every job with it
        )
        deadline = time.monotonic() + 300
        answered = 0
        while time.monotonic() < deadline and answered < 12:
            answered = sum(len(list(iter_journal(j))) for j in journals)
            time.sleep(0.1)
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        assert 12 <= answered < 40, "the kill landed mid-generation"
        locked = snakemake(workdir, *RAW, config=config, cores=4)
        assert locked.returncode != 0 and "cannot be locked" in locked.stderr + locked.stdout
        assert snakemake(workdir, "--unlock", config=config).returncode == 0
        rerun = snakemake(workdir, *RAW, config=config, cores=4)
        requests_total = httpx.get(f"{url}/stats", timeout=5).json()["requests_total"]
    assert rerun.returncode == 0, rerun.stderr[-4000:] + job_logs(workdir)
    ids = pl.concat([pl.read_parquet(workdir / path) for path in RAW])["id"]
    assert ids.n_unique() == ids.len() == 40
    for journal in journals:
        journal_ids = [record["id"] for record in iter_journal(journal)]
        assert len(journal_ids) == len(set(journal_ids)), f"{journal} has an id twice"
    # The probe's requests and one per prompt, plus at most the ones in flight at the kill.
    assert requests_total <= 40 + 3 + 2 * CAP * len(SHARDS)
