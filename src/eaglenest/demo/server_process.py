"""Run `eaglenest serve` as a child process for exactly the duration of a `with` block.

Pipeline jobs that need an endpoint (probe, generation) and tests start the server with
`running_server(...)` (or `embedded_server(config)` from the config's `server` section), get its
base URL, and are sure it is gone afterwards, also when the block raises. The child picks a free
port (`--port 0`) and announces it on stdout; its output goes to a log file so a server that
fails to start is reported with the tail of what it printed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from eaglenest.demo.faults import FAULT_MODES

# The module `eaglenest serve` runs in the child (eaglenest.cli's SUBCOMMANDS), so nothing here
# imports it; named so that code versions hash it with the stages it answers.
SERVER_MODULE = "eaglenest.demo.server"
LISTENING_PREFIX = "eaglenest serve: listening on "  # the server prints it with its URL
LOG_TAIL_CHARS = 4000
TERMINATE_TIMEOUT_S = 10.0


@contextlib.contextmanager
def running_server(
    model_path: str | Path | None = None,
    *,
    model_name: str,
    dialect: str = "vllm",
    echo: bool = False,
    rule: bool = False,
    echo_latency_s: float = 0.0,
    echo_latency_sigma: float = 0.0,
    faults: Mapping[str, float] | None = None,
    fault_seed: int = 0,
    hang_s: float = 60,
    retry_after_s: float = 1,
    max_batch_size: int = 64,
    log_path: str | Path | None = None,
    startup_timeout_s: float = 120,
    extra_args: Sequence[str] = (),
    trust_remote_code: bool = False,
    tokenizer_path: str | Path | None = None,
    threads: int | None = None,
) -> Iterator[str]:
    """Start the server, wait until /health answers, yield its base URL, always stop it.
    `rule`: a cite target answered from its rule (`eaglenest serve --rule`), not decoded."""
    if not echo and model_path is None:
        raise ValueError("running_server needs model_path, or echo=True to serve without a model")
    command = [sys.executable, "-m", "eaglenest.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    command += ["--served-model-name", model_name, "--dialect", dialect]
    command += ["--max-batch-size", str(max_batch_size), "--fault-seed", str(fault_seed)]
    command += ["--hang-s", str(hang_s), "--retry-after-s", str(retry_after_s)]
    command += [f"--fault={mode}={rate}" for mode, rate in (faults or {}).items() if rate]
    # If this process dies without running the `finally` below (SIGKILL, default SIGTERM), the
    # server notices it was orphaned and exits instead of holding its port and memory.
    command += ["--exit-with-parent", str(os.getpid())]
    if echo:
        command += ["--echo", "--echo-latency-s", str(echo_latency_s)]
        command += ["--echo-latency-sigma", str(echo_latency_sigma)]
    else:
        command += ["--model-path", str(model_path)]
        if rule:
            command.append("--rule")
        if tokenizer_path is not None:
            command += ["--tokenizer", str(tokenizer_path)]
        if trust_remote_code:
            command.append("--trust-remote-code")
        if threads is not None:
            command += ["--threads", str(threads)]
    command += list(extra_args)

    with contextlib.ExitStack() as cleanup:
        if log_path is None:
            log_file = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="eaglenest-serve-"))
            log_path = Path(log_file) / "server.log"
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_stream:
            start_offset = log_stream.tell()  # the log may hold earlier runs: read only ours
            process = subprocess.Popen(
                command,
                stdout=log_stream,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            yield _wait_until_ready(process, log_path, start_offset, startup_timeout_s)
        finally:
            _stop(process)


def _wait_until_ready(
    process: subprocess.Popen, log_path: Path, start_offset: int, timeout_s: float
) -> str:
    deadline = time.monotonic() + timeout_s
    base_url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"eaglenest serve exited with code {process.returncode} during startup; "
                f"end of its log ({log_path}):\n{_log_tail(log_path, start_offset)}"
            )
        if base_url is None:
            base_url = _announced_url(log_path, start_offset)
        if base_url is not None and _healthy(base_url):
            return base_url
        time.sleep(0.1)
    raise RuntimeError(
        f"eaglenest serve did not become healthy within {timeout_s} s; end of its log "
        f"({log_path}):\n{_log_tail(log_path, start_offset)}"
    )


def _announced_url(log_path: Path, start_offset: int) -> str | None:
    with open(log_path, "rb") as stream:
        stream.seek(start_offset)
        for line in stream.read().decode(errors="replace").splitlines():
            if line.startswith(LISTENING_PREFIX):
                return line[len(LISTENING_PREFIX) :].strip()
    return None


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(log_path: Path, start_offset: int) -> str:
    with open(log_path, "rb") as stream:
        stream.seek(start_offset)
        return stream.read().decode(errors="replace")[-LOG_TAIL_CHARS:]


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(TERMINATE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def embedded_server(
    config: Mapping[str, Any], log_path: str | Path | None = None, *, threads: int | None = None
) -> contextlib.AbstractContextManager[str]:
    """`running_server` for the target and `server` section of a (validated) pipeline config.

    `threads` (the job's CPU threads) caps torch's threads: on a busy machine, more torch threads
    than free cores make every decode step wait for the slowest one.
    """
    target = config.get("target") or {}
    server = config.get("server") or {}
    faults = server.get("faults") or {}
    if not target.get("path"):
        raise ValueError(
            "the embedded server (server.enabled) needs target.path: the directory of the "
            "target's weights and tokenizer"
        )
    return running_server(
        target["path"],
        model_name=target.get("model", "demo-qwen3"),
        dialect=server.get("dialect", "vllm"),
        rule=server.get("backend", "model") == "rule",
        faults={mode: float(faults.get(mode, 0.0)) for mode in FAULT_MODES},
        fault_seed=int(faults.get("seed", 0)),
        hang_s=float(faults.get("hang_s", 60)),
        retry_after_s=float(faults.get("retry_after_s", 1)),
        max_batch_size=int(server.get("max_batch_size", 64)),
        startup_timeout_s=float(server.get("startup_timeout_s", 120)),
        trust_remote_code=bool(target.get("trust_remote_code", False)),
        tokenizer_path=target.get("tokenizer"),
        log_path=log_path,
        extra_args=() if server.get("token_ids", True) else ("--no-token-ids",),
        threads=threads,
    )
