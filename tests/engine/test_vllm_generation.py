"""Generation against a real vLLM server (the CPU build, .venv-vllm): it serves the small demo
target on 127.0.0.1 (eager, tests/support/vllm.py), and probe, generate and prepare_samples of
one shard run through real Snakemake against it; then the same server is killed mid-run and
started again on its port, and the run goes on by itself.

One server for the module: the restart test kills it and starts it again with the same
arguments (two engine starts in all, not three)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from support.vllm import EAGER, SERVED_NAME, VllmServer
from support.workflow import copy_workflow, job_logs, planned_jobs, snakemake


@pytest.fixture(scope="module")
def generation_server(
    vllm_target_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """vLLM serving the small demo target, eager: its answers are compared with its own only."""
    server = VllmServer(vllm_target_dir, tmp_path_factory.mktemp("vllm") / "server.log",
                        engine_args=EAGER)  # fmt: skip
    started = time.monotonic()
    try:
        server.start()
        print(f"vLLM healthy after {time.monotonic() - started:.0f} s at {server.url}")
        yield server
    finally:
        server.stop()


def test_probe_generate_and_samples_against_a_real_vllm(
    tmp_path: Path, vllm_target_dir: Path, generation_server: VllmServer
):
    """vLLM answers in `reasoning` with the token ids it produced; every sample's tokens come
    from the server and the rebuild from the text agrees with them exactly."""
    vllm_url = generation_server.url
    workdir = copy_workflow(tmp_path / "workflow")
    target = "results/vllm/tokens/00000.parquet"
    config = {
        "run": "vllm",
        "demo_target": {"enabled": False},
        "server": {"enabled": False},
        "target": {"model": SERVED_NAME, "path": str(vllm_target_dir)},
        "endpoints": [{"url": vllm_url, "max_concurrency": 8}],
        "prompts": {"source": "demo", "max_samples": 8, "shard_size": 8},
        "generation": {"max_tokens": 128},
        "validation": {"max_truncated_fraction": 0.5},
        "train": {"eval_shards": 0},
    }
    assert planned_jobs(snakemake(workdir, target, "-n", config=config)) == {
        "probe_endpoints": 1,
        "prepare_prompts": 1,
        "generate_responses": 1,
        "prepare_samples": 1,
    }
    result = snakemake(workdir, target, config=config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + job_logs(workdir)

    run = workdir / "results" / "vllm"
    probe = json.loads((run / "probe.json").read_text())
    assert probe["reasoning_field"] == "reasoning"
    assert probe["token_ids"]["supported"] is True
    raw = pl.read_parquet(run / "raw" / "00000.parquet")
    assert raw.height == 8 and raw["error_kind"].null_count() == 8
    tokens = pl.read_parquet(run / "tokens" / "00000.parquet")
    assert tokens.height > 0
    assert set(tokens["token_source"]) == {"server"}
    report = json.loads((run / "tokens" / "00000.report.json").read_text())
    agreement = report["agreement"]
    print(f"probe: {probe['reasoning_field']}, {probe['token_ids']}; agreement: {agreement}")
    assert agreement["compared"] == tokens.height
    # Every rebuild holds the server's text; in the same ids, but where the model sampled a
    # tokenization the tokenizer would not choose (vLLM's batching can, on some runs).
    assert agreement["exact"] + agreement["retokenized"] == agreement["compared"], agreement
    assert agreement["exact"] >= agreement["compared"] // 2, agreement

    # Those answers were streamed (vLLM streams token ids); the same requests not streamed get the
    # same answers from the engine: the assembled stream is the body vLLM would have sent.
    log = (workdir / "logs/vllm/generate_responses/00000.log").read_text()
    assert "streaming: a request fails after" in log
    plain_config = config | {
        "run": "vllm-plain",
        "generation": {"max_tokens": 128, "stream": "never"},
    }
    plain_raw = "results/vllm-plain/raw/00000.parquet"
    result = snakemake(workdir, plain_raw, config=plain_config)
    assert result.returncode == 0, result.stderr[-3000:] + job_logs(workdir)
    plain = pl.read_parquet(workdir / plain_raw).sort("id")
    columns = ["id", "reasoning", "content", "reasoning_field", "finish_reason"]
    columns += ["prompt_token_ids", "completion_token_ids", "completion_tokens"]
    assert raw.sort("id").select(columns).equals(plain.select(columns))


def restart_settings(slots_dir: Path):
    """Streamed like any vLLM run, answers of 256 tokens each (ignore_eos), and retries that
    outlast a server restart (about 60-120 s here): up to 40 attempts, backoff up to 8 s."""
    from eaglenest.common.config import validate_config
    from eaglenest.settings.generate import GenerationClientSettings, RequestSettings
    from eaglenest.stages.generate.request import GenerationSettings

    config = validate_config(
        {
            "target": {"model": SERVED_NAME},
            "generation": {
                "max_tokens": 256, "extra_body": {"ignore_eos": True}, "concurrency": 2,
                "max_attempts": 40, "backoff_base_s": 1.0, "backoff_max_s": 8.0,
                "idle_timeout_s": 60.0, "bench_s": 1.0, "slots_dir": str(slots_dir),
            },
        }
    )  # fmt: skip
    return GenerationSettings.from_parts(
        RequestSettings.from_config(config),
        GenerationClientSettings.from_config(config),
        return_token_ids=True,
        layout="vllm",
    )


def test_a_vllm_server_killed_mid_run_and_restarted_answers_every_prompt_once(
    tmp_path: Path, generation_server: VllmServer
):
    """kill -9 of the server (its whole process group) while a shard's requests stream, then a
    new server on the same port: the run goes on by itself, every prompt is answered once, with
    exact token ids, and the raw rows show the retries."""
    import asyncio
    import threading

    from eaglenest.client.endpoints import Endpoint
    from eaglenest.client.journal import iter_journal
    from eaglenest.formats.raw import RawSchema, write_raw
    from eaglenest.stages.generate.generate import generate_records

    prompts = [
        {"id": f"{i:016x}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}]}
        for i in range(40)  # ~0.3 s each on the demo target, two at a time: ~6 s to kill in
    ]
    journal = tmp_path / "journal.jsonl"
    server = generation_server
    outcome: dict = {}

    def run() -> None:
        endpoint = Endpoint(server.url, max_concurrency=2)
        settings = restart_settings(tmp_path / "slots")
        try:
            outcome["records"] = asyncio.run(
                generate_records(prompts, [endpoint], settings, journal)
            )
        except Exception as err:  # noqa: BLE001 (reported by the test's thread)
            outcome["error"] = err

    generation = threading.Thread(target=run, daemon=True)
    generation.start()
    deadline = time.monotonic() + 300
    while len(list(iter_journal(journal))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    answered_at_kill = len(list(iter_journal(journal)))
    server.kill()
    assert 3 <= answered_at_kill < len(prompts), "the kill landed mid-run"
    server.start()  # the same arguments on the same port; the module's server from now on
    generation.join(600)
    assert not generation.is_alive() and "error" not in outcome, outcome
    records = outcome["records"]
    journal_ids = [record["id"] for record in iter_journal(journal)]
    assert sorted(journal_ids) == sorted(p["id"] for p in prompts), "each prompt journaled once"
    write_raw([records[p["id"]] for p in prompts], tmp_path / "raw.parquet")
    raw = RawSchema.validate(pl.read_parquet(tmp_path / "raw.parquet"))
    assert raw["error_kind"].null_count() == len(prompts)
    assert (raw["completion_token_ids"].list.len() == 256).all()
    retried = raw.filter(pl.col("attempts") > 1)
    print(f"{answered_at_kill} answered at the kill; attempts {sorted(raw['attempts'])}")
    assert retried.height >= 1, "the requests in flight at the kill were retried"
