"""The Kimi-K2.5-layout run of the engine lane (tests/engine/conftest.py: `kimi_run`): the
DeepSeek-V3 demo target wrapped as `KimiK25ForConditionalGeneration` (eaglenest.demo.kimi_layout),
served by vLLM with the `kimi_k2` parser for the samples, then the rest of the pipeline under
`eaglenest serve-capture`, as config/tests/kimi-k2.5-layout.yaml's header gives the commands."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from support.servers import free_port, wait_healthy
from support.vllm import VLLM_VENV, server_env
from support.workers import CORES
from support.workflow import DEMO_CONFIGFILE, load_test_config

KIMI = load_test_config("kimi-k2.5-layout")
KIMI_RUN = KIMI["run"]
STARTUP_TIMEOUT_S = 420


@contextlib.contextmanager
def kimi_server(model_dir: Path, log_path: Path, served_name: str) -> Iterator[str]:
    """vLLM's OpenAI server for the Kimi-K2.5 layout, as docs/vllm-cpu.md gives the command:
    the kimi_k2 parser, text only, the CPU fixes; yields its URL once /health answers."""
    from eaglenest.vllm_engine.cpu import config_uses_mla, cpu_engine_args, server_flags

    config = json.loads((model_dir / "config.json").read_text())
    engine_args = {"enforce_eager": True, "language_model_only": True}
    port = free_port()
    command = [
        str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_name,
        "--reasoning-parser", "kimi_k2", "--trust-remote-code",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
        "--dtype", "float32",
        *server_flags(cpu_engine_args(engine_args, target_uses_mla=config_uses_mla(config))),
    ]  # fmt: skip
    with open(log_path, "ab") as log_stream:
        process = subprocess.Popen(command, stdout=log_stream, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=server_env(), start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log_path, STARTUP_TIMEOUT_S, "vLLM (Kimi-K2.5 layout)")
        yield url
    finally:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(wait_s)
                break


def serve_capture_and_run(
    workdir: Path, log: Path, timeout_s: float
) -> subprocess.CompletedProcess:
    """`eaglenest serve-capture --configfile <the run's files> -- snakemake ...` (the rest of the
    run under one capture server, stopped when Snakemake ends)."""
    files = [DEMO_CONFIGFILE, str(workdir / "override.yaml")]
    command = [sys.executable, "-m", "eaglenest.cli", "serve-capture", "--configfile", *files,
               "--log", str(log), "--startup-timeout-s", "600", "--",
               sys.executable, "-m", "snakemake", "--cores", str(CORES), "--configfile", *files]  # fmt: skip
    # Its own process group, stopped whole on a timeout (Snakemake and its jobs with it). vLLM's
    # engine runs in a group of its own that serve-capture must stop: after a SIGKILL of
    # serve-capture it outlives it (issue 40, break 6, seen here after a timeout).
    process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
