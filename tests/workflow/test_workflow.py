"""Real Snakemake in a temp dir on a small demo config: the pipeline runs end to end (demo target,
embedded server, probe, prompts, generation, validation, tokens, hidden states, training,
evaluation, report) and a rerun does nothing; what a change reruns is in
tests/workflow/test_incremental.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import polars as pl
import pytest

# Shared with other workflow tests; `finished_run` is a session fixture in conftest.py.
from support.eval_sets import (
    write_demo_mt_bench,
    write_gsm8k_parquet,
    write_speed_bench_parquet,
)
from support.workflow import (
    DEMO_CONFIGFILE,
    SMALL_DEMO,
    SMALL_RUN,
    copy_workflow,
    job_logs,
    load_test_config,
    merged,
    planned_jobs,
    snakemake,
)

pytestmark = pytest.mark.slow


# The demo target is copied in (tests/conftest.py: finished_run): its build is not among the jobs.
ONCE_PER_RUN = (
    "prepare_prompts",
    "probe_endpoints",
    "build_draft_vocab",
    "save_target_head",
    "train_drafter",
    "evaluate_drafter",
    "build_report",
)
PER_SHARD = ("generate_responses", "prepare_samples", "extract_hidden_states")
EXPECTED_LOGS = (
    {f"{rule}.log" for rule in ONCE_PER_RUN}
    | {f"{rule}/{shard}.log" for rule in PER_SHARD for shard in ("00000", "00001")}
    | {"probe_endpoints.server.log", "generate_responses/00000.server.log"}
    | {"generate_responses/00001.server.log"}
)


def test_demo_pipeline_runs_end_to_end(finished_run: Path):
    run = finished_run / "results" / SMALL_RUN
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
    # One log per job: <rule>.log once per run, <rule>/<shard>.log per shard, the embedded server's
    # beside the job that started it (and the server is gone now).
    logs = finished_run / "logs" / SMALL_RUN
    assert {str(p.relative_to(logs)) for p in logs.rglob("*.log")} == EXPECTED_LOGS
    server_log = logs / "generate_responses" / "00000.server.log"
    assert "listening on http://127.0.0.1" in server_log.read_text()
    assert servers_started_in(finished_run) == []


def servers_started_in(workdir: Path) -> list[int]:
    """The embedded servers (`eaglenest.cli serve`) still running whose working directory is
    `workdir` (a job's server inherits it): another test's servers may run beside this one."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = Path(os.readlink(entry / "cwd"))
        except (OSError, ValueError):
            continue  # not a process, gone, or not ours to read
        if "eaglenest.cli serve" in command and cwd == workdir.resolve():
            found.append(int(entry.name))
    return found


def test_nothing_to_do_after_a_finished_run(finished_run_copy: Path):
    assert planned_jobs(snakemake(finished_run_copy, "-n", config=SMALL_DEMO)) == {}


def test_dict_param_key_order_reruns_nothing(finished_run_copy: Path):
    config = json.loads(json.dumps(SMALL_DEMO))
    config["generation"] = dict(reversed(list(config["generation"].items())))
    config["demo_target"] = dict(reversed(list(config["demo_target"].items())))
    assert planned_jobs(snakemake(finished_run_copy, "-n", config=config)) == {}


def test_client_settings_rerun_nothing(finished_run_copy: Path):
    config = merged(SMALL_DEMO, {"generation": {"concurrency": 7, "timeout_s": 30}})
    assert planned_jobs(snakemake(finished_run_copy, "-n", config=config)) == {}


def test_evaluation_sets_are_prepared_beside_a_finished_run(finished_run_copy: Path):
    """evaluate.sets added to a finished run: one prepare_eval_set job per set and nothing else
    (the small demo decodes in no engine, and the sets are decoded in vLLM only: neither an input
    nor a param of evaluate_drafter there); each set written, a SPEED-Bench file with its
    placeholder row failing its own job with the fix named."""
    sets = finished_run_copy / "sets"
    sets.mkdir()
    write_demo_mt_bench(sets / "question.jsonl")
    write_gsm8k_parquet(sets / "gsm8k.parquet")
    write_speed_bench_parquet(sets / "speed.parquet", placeholder_row=2)
    entries = [
        {"name": "mt_bench", "path": "sets/question.jsonl"},
        {"name": "gsm8k", "path": "sets/gsm8k.parquet"},
        {"name": "speed", "path": "sets/speed.parquet"},
    ]
    config = merged(SMALL_DEMO, {"evaluate": {"sets": entries}})
    planned = planned_jobs(snakemake(finished_run_copy, "-n", config=config))
    assert planned == {"prepare_eval_set": 3, "all": 1}
    result = snakemake(finished_run_copy, "--keep-going", config=config)
    assert result.returncode != 0
    run = finished_run_copy / "results" / SMALL_DEMO["run"] / "eval_sets"
    mt_bench = pl.read_parquet(run / "mt_bench.parquet")
    assert (
        mt_bench.height == 6 and json.loads((run / "gsm8k.report.json").read_text())["prompts"] == 2
    )
    assert not (run / "speed.parquet").exists()
    log = (
        finished_run_copy / "logs" / SMALL_DEMO["run"] / "prepare_eval_set" / "speed.log"
    ).read_text()
    assert "row 2: field 'turns[0]': holds SPEED-Bench's placeholder" in log
    assert "prepare_data.py --dataset speed" in log


def test_a_run_against_an_external_endpoint(tmp_path: Path, demo_target_dir: Path):
    """The usual set-up: a server the workflow does not start (here the real eaglenest server on
    127.0.0.1 over the demo target, as vLLM would be). Probe, prompts, generation and samples of
    one shard run through Snakemake, and no embedded-server log is planned or written."""
    from eaglenest.demo.server_process import running_server

    workdir = copy_workflow(tmp_path / "workflow")
    target = "results/ext/tokens/00000.parquet"
    with running_server(demo_target_dir, model_name="demo-ext") as url:
        config = {
            "run": "ext",
            "demo_target": {"enabled": False},
            "server": {"enabled": False},
            "target": {"model": "demo-ext", "path": str(demo_target_dir)},
            "endpoints": [{"url": url, "max_concurrency": 8}],
            "prompts": {"source": "demo", "max_samples": 8, "shard_size": 8},
            "generation": {"max_tokens": 160},
            "validation": {"max_truncated_fraction": 0.5},
            "train": {"eval_shards": 0},
        }
        dry = snakemake(workdir, target, "-n", config=config)
        assert planned_jobs(dry) == {
            "probe_endpoints": 1,
            "prepare_prompts": 1,
            "generate_responses": 1,
            "prepare_samples": 1,
        }
        assert "server.log" not in dry.stdout
        result = snakemake(workdir, target, config=config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + job_logs(workdir)
    run = workdir / "results" / "ext"
    raw = pl.read_parquet(run / "raw" / "00000.parquet")
    assert raw.height == 8 and raw["error_kind"].null_count() == 8
    assert pl.read_parquet(run / "tokens" / "00000.parquet").height > 0
    logs = workdir / "logs" / "ext"
    assert "prompt shard 00000" in (logs / "generate_responses" / "00000.log").read_text()
    assert not list(logs.rglob("*.server.log"))


def test_a_sampling_change_regenerates_and_a_client_change_asks_nothing(tmp_path: Path):
    """Through Snakemake against a server it does not start: raising the temperature reruns the
    shard and every prompt reaches the server again (the journal's answers were for another
    request); the raw rows carry the new temperature. Changing only concurrency asks nothing,
    even when the job is forced to rerun."""
    import httpx

    from eaglenest.demo.server_process import running_server

    workdir = copy_workflow(tmp_path / "workflow")
    target = "results/jr/raw/00000.parquet"

    def requests_total(url: str) -> int:
        return httpx.get(f"{url}/stats", timeout=5).json()["requests_total"]

    def raw_temperatures() -> set[float]:
        raw = pl.read_parquet(workdir / "results" / "jr" / "raw" / "00000.parquet")
        return {json.loads(r)["temperature"] for r in raw["request"].to_list()}

    with running_server(model_name="echo-model", echo=True) as url:
        config = {
            "run": "jr",
            "demo_target": {"enabled": False},
            "server": {"enabled": False},
            "target": {"model": "echo-model", "path": None},
            "endpoints": [{"url": url}],
            "prompts": {"source": "demo", "max_samples": 8, "shard_size": 8},
            "generation": {"temperature": 0.7},
            "probe": {"prompts": 2},
            "train": {"eval_shards": 0},
        }
        first = snakemake(workdir, target, config=config)
        assert first.returncode == 0, first.stderr[-3000:] + job_logs(workdir)
        assert requests_total(url) == 2 + 8  # the probe's two, then the shard's eight
        assert raw_temperatures() == {0.7}

        hotter = merged(config, {"generation": {"temperature": 0.9}})
        assert planned_jobs(snakemake(workdir, target, "-n", config=hotter)) == {
            "generate_responses": 1
        }
        second = snakemake(workdir, target, config=hotter)
        assert second.returncode == 0, second.stderr[-3000:] + job_logs(workdir)
        assert requests_total(url) == 10 + 8
        assert raw_temperatures() == {0.9}
        log = (workdir / "logs" / "jr" / "generate_responses" / "00000.log").read_text()
        assert "0 answers reused" in log and "8 re-asked because the request changed" in log

        faster = merged(hotter, {"generation": {"concurrency": 3}})
        assert planned_jobs(snakemake(workdir, target, "-n", config=faster)) == {}
        forced = snakemake(workdir, target, "--forcerun", "generate_responses", config=faster)
        assert forced.returncode == 0, forced.stderr[-3000:] + job_logs(workdir)
        assert requests_total(url) == 18
        assert raw_temperatures() == {0.9}
    raw = pl.read_parquet(workdir / "results" / "jr" / "raw" / "00000.parquet")
    assert raw["origin"].unique().to_list() == ["journal"]


@pytest.mark.parametrize(
    ("name", "reasoning_field", "token_ids", "token_source"),
    [
        ("rebuild-path", "reasoning", {"supported": False}, "rebuilt"),
        ("sglang-dialect", "reasoning_content", {"supported": True, "layout": "sglang"}, "server"),
    ],
)
def test_a_test_config_runs_as_a_person_runs_it(
    tmp_path: Path,
    demo_target_dir: Path,
    name: str,
    reasoning_field: str,
    token_ids: dict,
    token_source: str,
):
    """config/tests/<name>.yaml through one shard's samples, with the command line a person uses
    (`--configfile config/config.yaml <file>`: a variant of the demo). The demo target it would build (demo-small's,
    tests/unit/common/test_config.py) is copied in: prompts, probe, generation and samples run."""
    run_name = load_test_config(name)["run"]
    workdir = copy_workflow(tmp_path / "workflow")
    shutil.copytree(demo_target_dir, workdir / "results" / run_name / "target")
    target = f"results/{run_name}/tokens/00000.parquet"
    result = snakemake(
        workdir, target, "--configfile", DEMO_CONFIGFILE, f"config/tests/{name}.yaml"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + job_logs(workdir)
    run = workdir / "results" / run_name
    probe = json.loads((run / "probe.json").read_text())
    assert probe["reasoning_field"] == reasoning_field
    assert {k: probe["token_ids"][k] for k in token_ids} == token_ids
    samples = pl.read_parquet(run / "samples" / "00000.parquet")
    assert samples.height > 0
    assert samples["reasoning_field"].unique().to_list() == [reasoning_field]
    tokens = pl.read_parquet(run / "tokens" / "00000.parquet")
    assert tokens.height > 0
    assert tokens["token_source"].unique().to_list() == [token_source]
