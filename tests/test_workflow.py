"""Real Snakemake in a temp dir on a small demo config: the pipeline runs end to end (demo target,
embedded server, probe, prompts, generation, validation), and reruns only what a change touches."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from conftest import DEMO_TARGET_TEST_SETTINGS

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = ("Snakefile", "rules", "scripts", "config", "profiles", "envs")

SMALL_DEMO = {
    "demo_target": {"enabled": True, **DEMO_TARGET_TEST_SETTINGS},
    "prompts": {"source": "demo", "max_samples": 40, "shard_size": 20},
    "generation": {"max_tokens": 160},
    # The test target is trained briefly: allow some answers to run past max_tokens.
    "validation": {"max_truncated_fraction": 0.5},
}

pytestmark = pytest.mark.slow


def snakemake(workdir: Path, *args: str, config: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "snakemake", "--cores", "2", *args]
    if config is not None:
        path = workdir / "override.yaml"
        path.write_text(yaml.safe_dump(config))
        command += ["--configfile", str(path)]
    return subprocess.run(
        command, cwd=workdir, capture_output=True, text=True, timeout=900, check=False
    )


def planned_jobs(result: subprocess.CompletedProcess) -> dict[str, int]:
    """Job counts per rule from a dry run's 'Job stats' table ({} when nothing to do)."""
    assert result.returncode == 0, result.stdout + result.stderr
    counts: dict[str, int] = {}
    in_table = False
    for line in result.stdout.splitlines():
        if line.startswith("job ") and "count" in line:
            in_table = True
            continue
        if in_table:
            match = re.match(r"^(\w+)\s+(\d+)$", line.strip())
            if match and match.group(1) != "total":
                counts[match.group(1)] = int(match.group(2))
            elif line.strip() and not line.startswith("---") and not match:
                break
    return counts


def merged(base: dict, change: dict) -> dict:
    out = json.loads(json.dumps(base))
    for section, values in change.items():
        out.setdefault(section, {}).update(values)
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("workflow")
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, workdir / name)
        else:
            shutil.copy(src, workdir / name)
    result = snakemake(workdir, config=SMALL_DEMO)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((workdir / "logs").rglob("*.log")))
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:] + logs
    return workdir


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


def test_two_more_shards_add_exactly_their_jobs(finished_run: Path):
    config = merged(SMALL_DEMO, {"prompts": {"max_samples": 80}})
    jobs = planned_jobs(snakemake(finished_run, "-n", config=config))
    assert jobs == {
        "shard_prompts": 2,
        "generate_responses": 2,
        "validate_samples": 2,
        "tokenize_samples": 2,
        "extract_hidden_states": 2,
        "build_draft_vocab": 1,  # merges the counts of every shard
        "all": 1,
    }


def test_a_sampling_parameter_reruns_generation_for_every_shard(finished_run: Path):
    config = merged(SMALL_DEMO, {"generation": {"temperature": 0.3}})
    jobs = planned_jobs(snakemake(finished_run, "-n", config=config))
    assert jobs == {
        "generate_responses": 2,
        "validate_samples": 2,
        "tokenize_samples": 2,
        "extract_hidden_states": 2,
        "build_draft_vocab": 1,
        "all": 1,
    }


def test_dict_param_key_order_reruns_nothing(finished_run: Path):
    config = json.loads(json.dumps(SMALL_DEMO))
    config["generation"] = dict(reversed(list(config["generation"].items())))
    config["demo_target"] = dict(reversed(list(config["demo_target"].items())))
    assert planned_jobs(snakemake(finished_run, "-n", config=config)) == {}


def test_client_settings_rerun_nothing(finished_run: Path):
    config = merged(SMALL_DEMO, {"generation": {"concurrency": 7, "timeout_s": 30}})
    assert planned_jobs(snakemake(finished_run, "-n", config=config)) == {}


def test_a_validation_threshold_reruns_validation_only(finished_run: Path):
    config = merged(SMALL_DEMO, {"validation": {"max_truncated_fraction": 0.4}})
    jobs = planned_jobs(snakemake(finished_run, "-n", config=config))
    assert jobs == {
        "validate_samples": 2,
        "tokenize_samples": 2,
        "extract_hidden_states": 2,
        "build_draft_vocab": 1,
        "all": 1,
    }
