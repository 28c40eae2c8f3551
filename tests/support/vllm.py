"""The real vLLM of the tests: the CPU build in .venv-vllm (`make vllm`), the settings that
compare its figures with the project's own, the DeepSeek-V3 and Kimi-K2.5-layout test configs,
and a vLLM OpenAI server started and stopped for a test (tests/engine/ uses them; its conftest
holds the engines the lane shares)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from eaglenest.vllm_engine.process import stop_process_group
from support.servers import free_port, wait_healthy
from support.workflow import REPO, SMALL_DEMO, SMALL_RUN, load_test_config, merged

VLLM_VENV = REPO / ".venv-vllm"
VLLM_STAMP = VLLM_VENV / ".installed"  # written by `make vllm` once the install is complete
VLLM_PYTHON = str(VLLM_VENV / "bin" / "python")  # not resolved: the venv's python is a link
# Exact storage and the target in float32 in both backends: differences are vLLM's kernels only.
EXACT = {"dtype": "fp32", "model_dtype": "float32", "device": "cpu"}
# Every engine of the tests runs eager: it starts in ~15 s instead of ~50 s (no compilation), and
# with vLLM's custom ops on, which is where the CPU rotary bug shows (eaglenest.vllm_engine.cpu).
# The figures compared with our own (capture, acceptance) were re-baselined in eager once.
EAGER = {"enforce_eager": True}
# The pipeline's own engines (capture, evaluation): the `vllm` section of a test run's config.
PIPELINE_VLLM = {"python": VLLM_PYTHON, "engine_args": EAGER}
# vLLM logs this once per engine it starts (EngineCore's init), offline or served.
ENGINE_START_LINE = "Initializing a V1 LLM engine"

# The hidden-state shards of `finished_run` (SMALL_DEMO: 40 prompts in shards of 20).
CAPTURE_SHARDS = ("00000", "00001")

# The DeepSeek-V3 demo (tests/engine/conftest.py: deepseek_target_dir, deepseek_run).
DEEPSEEK = load_test_config("deepseek-v3")
DEEPSEEK_RUN = DEEPSEEK["run"]
# The DeepSeek-V3 demo target wrapped as `KimiK25ForConditionalGeneration`
# (eaglenest.demo.kimi_layout), served with the kimi_k2 parser (tests/engine/conftest.py:
# kimi_run), as config/tests/kimi-k2.5-layout.yaml's header gives the commands.
KIMI = load_test_config("kimi-k2.5-layout")
KIMI_RUN = KIMI["run"]

SERVED_NAME = "demo-vllm"
# vLLM's start on two busy cores: about 20 s eager alone, a few minutes beside other work.
STARTUP_TIMEOUT_S = 420


def require_vllm_venv() -> None:
    """Skips the test without .venv-vllm; in CI (CI=true) fails it, as `make test` makes one."""
    if not VLLM_STAMP.exists():
        reason = f"{VLLM_VENV.name} is absent: `make vllm` installs a real vLLM (CPU build)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; in CI `make test` must have created it")
        pytest.skip(reason)


def capture_config(capture_url: str | None = None, **vllm) -> dict:
    """`SMALL_DEMO` with its hidden states captured by vLLM, stored exactly: over `finished_run`
    only extract_hidden_states reruns. `capture_url`: the capture server's, None for the offline
    backend (an engine per shard job); `vllm`: further keys of the `vllm` section."""
    return merged(SMALL_DEMO, {
        "hidden": {**EXACT, "backend": "vllm"},
        "vllm": {**PIPELINE_VLLM, "capture_url": capture_url, **vllm},
    })  # fmt: skip


def hidden_targets() -> list[str]:
    return [f"results/{SMALL_RUN}/hidden/{shard}.safetensors" for shard in CAPTURE_SHARDS]


def engine_starts(*logs: Path) -> int:
    """The engines these logs show starting."""
    return sum(path.read_text(errors="replace").count(ENGINE_START_LINE) for path in logs)


def server_env() -> dict[str, str]:
    """The environment of a vLLM server a test starts as a user would: a KV cache of 1 GiB, and
    under xdist the worker's threads as the pipeline's own engines get them (engine_thread_env:
    no OpenMP thread pinned to a core the other worker uses), the worker thread in the engine
    core's process (as worker_in_engine_core has it in a job: one import of vLLM fewer)."""
    from eaglenest.vllm_engine.process import engine_thread_env

    threads = engine_thread_env()
    if threads:
        threads["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return {**os.environ, **threads, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


def start_vllm_server(server: VllmServer) -> subprocess.Popen:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails for the
    vllm-cpu distribution) for `server`, in its own process group, not waited for. The CPU
    fixes come from where the pipeline's own engines get them (eaglenest.vllm_engine.cpu)."""
    from eaglenest.vllm_engine.cpu import config_uses_mla, cpu_engine_args, server_flags

    model_dir, engine_args = server.model_dir, server.engine_args
    mla = config_uses_mla(json.loads((model_dir / "config.json").read_text()))
    remote_code = ["--trust-remote-code"] if server.trust_remote_code else []
    command = [
        VLLM_PYTHON,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        server.served_name,
        "--reasoning-parser",
        server.reasoning_parser,
        *remote_code,
        "--host",
        "127.0.0.1",
        "--port",
        str(server.port),
        "--max-model-len",
        "1024",
        "--dtype",
        "float32",
        *server_flags(cpu_engine_args(engine_args or {}, target_uses_mla=mla)),
    ]
    with open(server.log_path, "ab") as log_stream:
        return subprocess.Popen(
            command,
            stdout=log_stream,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=server_env(),
            start_new_session=True,
        )


class VllmServer:
    """A vLLM server on a port of its own, which a test may kill and start again there with the
    same arguments (the restart test does, on the generation tests' server). `engine_args` are
    further server options; `reasoning_parser` is Qwen3's by default, whose think tags are the
    demo tokenizer's whatever the architecture (the Kimi-K2.5 layout's is kimi_k2, with its
    remote code trusted)."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        served_name: str = SERVED_NAME,
        engine_args: dict | None = None,
        reasoning_parser: str = "qwen3",
        trust_remote_code: bool = False,
    ) -> None:
        self.model_dir, self.log_path = model_dir, log_path
        self.served_name, self.engine_args = served_name, engine_args
        self.reasoning_parser, self.trust_remote_code = reasoning_parser, trust_remote_code
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        """Starts it and waits until /health answers."""
        self.process = start_vllm_server(self)
        wait_healthy(self.process, self.url, self.log_path, STARTUP_TIMEOUT_S, "vLLM")

    def kill(self) -> None:
        """kill -9 of the server and its engine processes (its whole process group)."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process)


@contextlib.contextmanager
def vllm_server(model_dir: Path, log_path: Path, **options) -> Iterator[str]:
    """A vLLM server on a free port (`options`: VllmServer's); yields its base URL once /health
    answers, and stops it and its engine when the block ends."""
    server = VllmServer(model_dir, log_path, **options)
    try:
        server.start()
        yield server.url
    finally:
        server.stop()
