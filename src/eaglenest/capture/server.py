"""`eaglenest serve-capture`: one vLLM capture engine for every hidden-state shard of a run.

    eaglenest serve-capture --configfile config/examples/kimi-k2.5.yaml -- \\
        snakemake --cores all --configfile config/examples/kimi-k2.5.yaml

starts vLLM's OpenAI server over the run's target with the `extract_hidden_states` method and
our connector (vllm_engine/serve.py: the offline capture's engine arguments, CPU fixes included,
chunked prefill and prefix caching off), at this node's address among the config's
`vllm.capture_urls` (server_address), waits until its own process is alive and lists the run's
served name, runs the command, and stops the server when the command ends, fails or is
interrupted, so nothing of it outlives the run. Without a command it serves until stopped
(Ctrl-C, SIGTERM): on a cluster, one a node, inside the allocation that runs the capture jobs,
with `--storage-dir` on a filesystem those jobs see.

While it serves, the server is watched (capture/supervisor.py): when it dies it is restarted at
the same address at most `--restarts` times (the pool's jobs take requests there again), the
command running on; then the command is stopped and serve-capture exits non-zero, with the
server's last error lines. With `vllm.capture_key_env`, the key in that variable is vLLM's
(VLLM_API_KEY, never argv) and every request needs it; without one, only a loopback address.

The server writes one state file per request into the storage directory (by default a fresh
temporary one, removed when it stops; its log then lies beside it, and is kept when the server
died, as the message that says so names it); each shard job reads and deletes its own
(capture/pool.py). It serves under a name that hashes what shapes the states
(capture/request.served_name), so a job of a run with another target, dtype, engine arguments or
aux layers is refused instead of packing the wrong states.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eaglenest.capture.key import CaptureKeyError, capture_key
from eaglenest.capture.request import capture_engine_request, served_name
from eaglenest.capture.supervisor import SupervisedServer, child_env, port_taken
from eaglenest.common.command import COMMAND_STOP_WAIT_S, start_command
from eaglenest.common.config import ConfigError, merged_config
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.vllm import VllmRuntime, capture_urls
from eaglenest.target_model.files import TargetNotFoundError, resolve_target_dir
from eaglenest.target_model.loading import checked_aux_layer_ids, load_text_config
from eaglenest.vllm_engine.process import (
    EngineError,
    engine_python,
    engine_thread_env,
    our_pythonpath,
    stop_process_group,
)

log = logging.getLogger(__name__)

SERVE_MODULE = "eaglenest.vllm_engine.serve"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8765
DEFAULT_RESTARTS = 2  # a crash that repeats costs at most two more target loads
WATCH_S = 2.0  # how often the server is checked while it serves


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
    request = capture_engine_request(
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


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name (the node's, in capture_urls): reachable from the network


def checked_key(runtime: VllmRuntime, host: str) -> str | None:
    """The capture key (vllm.capture_key_env's variable), refused when unset or blank
    (capture/key.py); and no bind beyond loopback without one: anything that reaches the port
    could fill the storage with states."""
    key = capture_key(runtime.capture_key_env, where="serve-capture's environment")
    if key is None and not is_loopback(host):
        raise EngineError(
            f"serve-capture: host {host} is reachable beyond this machine and the servers take "
            "no key: set vllm.capture_key_env to the name of a variable holding one (the jobs "
            "send it too), or bind 127.0.0.1"
        )
    return key


@contextlib.contextmanager
def capture_server(
    config: dict[str, Any],
    *,
    host: str | None = None,
    port: int | None = None,
    storage_dir: str | None = None,
    log_path: str | None = None,
    startup_timeout_s: float = 1800,
    restarts: int = DEFAULT_RESTARTS,
) -> Iterator[SupervisedServer]:
    """The capture server, running and answering inside the block (its `check()` restarts it
    when it died); stopped when the block ends, however it ends."""
    host, port = server_address(config, host, port)
    key = checked_key(VllmRuntime.from_config(config), host)
    url = f"http://{host}:{port}"
    taken = port_taken(host, port)
    if taken:
        raise EngineError(f"serve-capture: {taken}; nothing was started ({url})")
    temporary = storage_dir is None
    storage = Path(storage_dir or tempfile.mkdtemp(prefix="eaglenest-capture-"))
    storage.mkdir(parents=True, exist_ok=True)
    # Its log tells why it died: beside the states, or beside a temporary storage (removed when
    # serve-capture ends), where it stays when the server died so that the message naming it
    # can be followed.
    default_log = storage.parent / f"{storage.name}.log" if temporary else storage / "server.log"
    keep_log = log_path is not None or not temporary
    request = server_request(config, storage, host, port)
    python = engine_python(config["vllm"]["python"])
    request_path = storage / "server-request.json"
    request_path.write_text(json.dumps(request, indent=1))
    env = {
        **os.environ,
        # In a job (its threads set), the job's threads and no OpenMP pinning, as the pipeline's
        # other engines: then vLLM's worker runs in the engine core's process (serve.py).
        **engine_thread_env(),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": our_pythonpath(),
        "VLLM_CPU_KVCACHE_SPACE": str(config["vllm"]["cpu_kvcache_space_gb"]),
    }
    if key is None and os.environ.get("VLLM_API_KEY"):
        log.warning(
            "VLLM_API_KEY of serve-capture's environment is not given to the server: the "
            "config names no key (vllm.capture_key_env), so the jobs send none"
        )
    server = SupervisedServer(
        argv=[python, "-m", SERVE_MODULE, str(request_path)],
        env=child_env(env, key),
        log_path=Path(log_path) if log_path else default_log,
        url=url,
        served_name=request["served_name"],
        key=key,
        restarts=restarts,
        startup_timeout_s=startup_timeout_s,
    )
    try:
        ready_s = server.start()
        log.info("capture server ready at %s after %.1f s (%s)", url, ready_s, request_path)
        server.announced = {
            "url": url,
            "served_name": request["served_name"],
            "storage_dir": str(storage),
            "ready_s": round(ready_s, 3),
        }
        yield server
    except EngineError:  # it died, or never got ready: its log is what says why
        keep_log = True
        raise
    finally:
        server.stop()
        request_path.unlink(missing_ok=True)
        if temporary:
            shutil.rmtree(storage, ignore_errors=True)
            if not (keep_log or server.restarted):  # a restart's message named it too
                default_log.unlink(missing_ok=True)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--configfile", nargs="+", required=True, help="the run's config files")
    parser.add_argument("--host", help="default: this node's capture URL's, else 127.0.0.1")
    parser.add_argument("--port", type=int, help="default: this node's capture URL's, else 8765")
    parser.add_argument("--storage-dir", help="state files (default: a temp dir, removed)")
    parser.add_argument(
        "--log",
        help="vLLM's log (default: server.log in --storage-dir; without one, <the temporary "
        "storage>.log beside it, kept when the server died)",
    )
    parser.add_argument("--startup-timeout-s", type=float, default=1800)
    parser.add_argument(
        "--restarts",
        type=int,
        default=DEFAULT_RESTARTS,
        help=f"restarts of a server that died, at most (default {DEFAULT_RESTARTS}); then "
        "serve-capture stops its command and exits non-zero",
    )
    parser.add_argument("command", nargs="*", help="after --: run it, then stop the server")


def run(args: Any) -> int:
    try:
        return serve(args)
    except (EngineError, ConfigError, CaptureKeyError) as err:
        log.error("%s", err)
        return 2


def serve(args: Any) -> int:
    config = merged_config(args.configfile)
    if args.restarts < 0:
        raise EngineError(f"serve-capture: --restarts {args.restarts}: 0 or more")
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
            restarts=args.restarts,
        ) as server:
            print("EAGLENEST " + json.dumps(server.announced), flush=True)
            return watch(server, args.command)
    except KeyboardInterrupt:
        return 130


def watch(server: SupervisedServer, command: list[str]) -> int:
    """Serve while `command` runs (without one, until stopped), checking the server every
    WATCH_S: a dead one is restarted while the command keeps running; once no restart is left,
    the command is stopped as Ctrl-C stops it and ServerDied is raised."""
    # Dies with this process, as the server does: a killed run leaves nothing behind.
    process = start_command(command) if command else None
    try:
        while process is None or process.poll() is None:
            server.check()
            time.sleep(WATCH_S)
        return process.returncode
    finally:
        # Stopped with SIGINT, never SIGTERM, which can deadlock Snakemake (common.command).
        if process is not None and process.poll() is None:
            stop_process_group(process, COMMAND_STOP_WAIT_S, first=signal.SIGINT)
            process.wait()
