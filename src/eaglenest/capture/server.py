"""`eaglenest serve-capture`: one vLLM capture engine for every hidden-state shard of a run.

    eaglenest serve-capture --configfile config/examples/kimi-k2.5.yaml -- \\
        snakemake --cores all --configfile config/examples/kimi-k2.5.yaml

starts vLLM's OpenAI server over the run's target with the `extract_hidden_states` method and
our connector (vllm_engine/serve.py: the offline capture's engine arguments, CPU fixes included, chunked
prefill and prefix caching off), at this node's address among the config's `vllm.capture_urls`
(server_address), waits until it answers, runs the command, and stops the server when the command
ends, fails or is interrupted, so nothing of it outlives the run. Without a command it serves
until stopped (Ctrl-C, SIGTERM): on a cluster, one a node, inside the allocation that runs the
capture jobs, with `--storage-dir` on a filesystem those jobs see.

The server writes one state file per request into the storage directory (by default a fresh
temporary one, removed when it stops); each shard job reads and deletes its own
(capture_client.py). It serves under a name that hashes what shapes the states
(capture_client.served_name), so a job of a run with another target, dtype, engine arguments or
aux layers is refused instead of packing the wrong states.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eaglenest.capture.request import engine_request, served_name
from eaglenest.common.command import run_command
from eaglenest.common.config import ConfigError, merged_config
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.vllm import VllmRuntime, capture_urls
from eaglenest.target_model.files import TargetNotFoundError, resolve_target_dir
from eaglenest.target_model.loading import checked_aux_layer_ids, load_text_config
from eaglenest.vllm_engine.process import (
    EngineError,
    die_with_parent,
    engine_python,
    engine_thread_env,
    our_pythonpath,
    stop_process_group,
)

log = logging.getLogger(__name__)

SERVE_MODULE = "eaglenest.vllm_engine.serve"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8765
STOP_WAIT_S = 30


def server_address(config: dict[str, Any], host: str | None, port: int | None) -> tuple[str, int]:
    """Host and port: given, else those of this node's capture URL (the one URL of
    `vllm.capture_urls`/`capture_url`; of several, the one naming this machine, narrowed by the
    port when given), else 127.0.0.1:8765."""
    urls = [urllib.parse.urlsplit(url) for url in capture_urls(config["vllm"])]
    chosen = urls[0] if len(urls) == 1 else None
    if len(urls) > 1:
        names = local_names()
        mine = [u for u in urls if u.hostname in names and port in (None, u.port)]
        if len(mine) == 1:
            chosen = mine[0]
        elif not (host and port):
            raise EngineError(
                f"serve-capture: {len(mine)} of the {len(urls)} URLs of vllm.capture_urls name "
                f"this machine ({socket.gethostname()}{f', port {port}' if port else ''}): pass "
                "--host and --port (the address this node's server answers at)"
            )
    return (
        host or (chosen.hostname if chosen else None) or DEFAULT_HOST,
        port or (chosen.port if chosen else None) or DEFAULT_PORT,
    )


def local_names() -> set[str]:
    """What a capture URL may call this machine."""
    name = socket.gethostname()
    return {name, name.split(".")[0], socket.getfqdn(), "localhost", "127.0.0.1"}


def server_request(config: dict[str, Any], storage: Path, host: str, port: int) -> dict:
    """What vllm_engine/serve.py starts vLLM with: the offline capture's request (vllm_backend), the
    target's absolute path, the address and the served name the shard jobs expect."""
    if config["hidden"]["backend"] != "vllm":
        raise EngineError("serve-capture: hidden.backend is not vllm in this config")
    settings, runtime = HiddenSettings.from_config(config), VllmRuntime.from_config(config)
    target = settings.target
    try:
        target_dir = resolve_target_dir(target.path)
    except TargetNotFoundError as err:
        demo = config["demo_target"]["enabled"]
        hint = f"; the demo's is built by `snakemake {target.path}`" if demo else ""
        raise EngineError(f"serve-capture: {err}{hint}") from err
    model_config = load_text_config(target.path, target.trust_remote_code)
    layer_ids = [*checked_aux_layer_ids(model_config, settings), model_config.num_hidden_layers]
    request = engine_request(
        target_dir=target_dir.resolve(),
        layer_ids=layer_ids,
        settings=settings,
        runtime=runtime,
        work_dir=storage,
        longest=0,
        trust_remote_code=target.trust_remote_code,
    )
    # Samples' lengths are not known yet: vllm.max_model_len, else the target's own limit.
    request["max_model_len"] = runtime.max_model_len
    request.update(host=host, port=port, served_name=served_name(request))
    return request


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def capture_server(
    config: dict[str, Any],
    *,
    host: str | None = None,
    port: int | None = None,
    storage_dir: str | None = None,
    log_path: str | None = None,
    startup_timeout_s: float = 1800,
) -> Iterator[dict[str, Any]]:
    """The capture server, running and answering inside the block; stopped when it ends, however
    it ends. Yields the url, served name, storage directory and seconds to ready."""
    host, port = server_address(config, host, port)
    storage = Path(storage_dir or tempfile.mkdtemp(prefix="eaglenest-capture-"))
    storage.mkdir(parents=True, exist_ok=True)
    request = server_request(config, storage, host, port)
    python = engine_python(config["vllm"]["python"])
    request_path = storage / "server-request.json"
    request_path.write_text(json.dumps(request, indent=1))
    url = f"http://{host}:{port}"
    env = {
        **os.environ,
        # In a job (its threads set), the job's threads and no OpenMP pinning, as the pipeline's
        # other engines: then vLLM's worker runs in the engine core's process (serve.py).
        **engine_thread_env(),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": our_pythonpath(),
        "VLLM_CPU_KVCACHE_SPACE": str(config["vllm"]["cpu_kvcache_space_gb"]),
    }
    started = time.monotonic()
    with open(log_path or os.devnull, "ab") as log_stream:
        process = subprocess.Popen(
            [python, "-m", SERVE_MODULE, str(request_path)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_stream,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 (one call looked up before the fork)
        )
    try:
        wait_ready(process, url, startup_timeout_s, log_path)
        ready_s = time.monotonic() - started
        log.info("capture server ready at %s after %.1f s (%s)", url, ready_s, request_path)
        yield {
            "url": url,
            "served_name": request["served_name"],
            "storage_dir": str(storage),
            "ready_s": round(ready_s, 3),
        }
    finally:
        stop_process_group(process, STOP_WAIT_S)
        request_path.unlink(missing_ok=True)
        if storage_dir is None:
            shutil.rmtree(storage, ignore_errors=True)


def wait_ready(process: subprocess.Popen, url: str, timeout_s: float, log_path) -> None:
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            state = f"exited ({process.returncode})" if process.poll() is not None else "timed out"
            tail = Path(log_path).read_text()[-4000:] if log_path else "(no --log given)"
            raise EngineError(f"capture server at {url} {state} before it answered:\n{tail}")
        time.sleep(1)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--configfile", nargs="+", required=True, help="the run's config files")
    parser.add_argument("--host", help="default: this node's capture URL's, else 127.0.0.1")
    parser.add_argument("--port", type=int, help="default: this node's capture URL's, else 8765")
    parser.add_argument("--storage-dir", help="state files (default: a temp dir, removed)")
    parser.add_argument("--log", help="vLLM's log (default: discarded)")
    parser.add_argument("--startup-timeout-s", type=float, default=1800)
    parser.add_argument("command", nargs="*", help="after --: run it, then stop the server")


def run(args: Any) -> int:
    try:
        return serve(args)
    except (EngineError, ConfigError) as err:
        log.error("%s", err)
        return 2


def serve(args: Any) -> int:
    config = merged_config(args.configfile)
    # SIGTERM (a scheduler ending the allocation) stops the server as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with capture_server(
            config,
            host=args.host,
            port=args.port,
            storage_dir=args.storage_dir,
            log_path=args.log,
            startup_timeout_s=args.startup_timeout_s,
        ) as server:
            print("EAGLENEST " + json.dumps(server), flush=True)
            if not args.command:
                while True:
                    time.sleep(3600)
            # Dies with this process, as the server does: a killed run leaves nothing behind.
            # Stopped with SIGINT, never SIGTERM, which can deadlock Snakemake (common.command).
            return run_command(args.command)
    except KeyboardInterrupt:
        return 130
