"""`eaglenest serve`: an OpenAI-compatible chat-completions server for a local causal LM.

It serves any transformers model directory (or, with `--echo`, canned answers with no model) on
127.0.0.1 and speaks the dialects real servers speak (vLLM, SGLang, none: see protocol.py), so
the pipeline and its tests meet the same shapes they meet in production. This module is its
command line and serving loop; the routes and fault injection are app.py's, the answers come from
echo_backend.py, model_backend.py (generation in batches on a batcher thread, batcher.py) or, for
the cite target, rule_backend.py (its rule, which its greedy decoding follows).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from aiohttp import web

from eaglenest.demo.app import create_app
from eaglenest.demo.echo_backend import EchoBackend
from eaglenest.demo.faults import FAULT_MODES, FaultConfig, parse_fault_specs
from eaglenest.demo.model_backend import ModelBackend
from eaglenest.demo.protocol import DIALECTS
from eaglenest.demo.rule_backend import RuleBackend
from eaglenest.demo.server_process import LISTENING_PREFIX

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    what = parser.add_argument_group("what to serve")
    what.add_argument("--model-path", help="local transformers model directory")
    what.add_argument("--tokenizer", help="tokenizer directory (default: --model-path)")
    what.add_argument(
        "--served-model-name", help="name clients send as `model` (default: dir name)"
    )
    what.add_argument("--trust-remote-code", action="store_true")
    what.add_argument("--echo", action="store_true", help="no model: answer with canned text")
    what.add_argument(
        "--rule",
        action="store_true",
        help="a cite target (--model-path): answer from its rule, as its greedy decoding does, "
        "without running the model (rule_backend.py)",
    )
    what.add_argument(
        "--echo-latency-s", type=float, default=0.0, help="echo: seconds per answer (the median)"
    )
    what.add_argument(
        "--echo-latency-sigma",
        type=float,
        default=0.0,
        help="echo: lognormal spread of the latency (0: fixed; 1: like reasoning lengths)",
    )
    what.add_argument("--dialect", choices=DIALECTS, default="vllm")
    what.add_argument(
        "--no-token-ids",
        action="store_true",
        help="ignore return_token_ids (as servers that predate it do)",
    )
    where = parser.add_argument_group("where")
    where.add_argument("--host", default="127.0.0.1")
    where.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    where.add_argument("--access-log", action="store_true", help="log every request")
    # Set by server_process.running_server: exit when that process is gone.
    where.add_argument("--exit-with-parent", type=int, metavar="PID", help=argparse.SUPPRESS)
    how = parser.add_argument_group("generation")
    how.add_argument("--max-batch-size", type=int, default=64)
    how.add_argument(
        "--gather-window-s",
        type=float,
        default=0.005,
        help="how long the batcher waits for more requests before starting a batch",
    )
    how.add_argument("--max-model-len", type=int, help="default: max_position_embeddings")
    how.add_argument(
        "--default-max-tokens",
        type=int,
        help="max_tokens of requests that send none (default: generation_config's "
        "max_new_tokens, else 4096; capped by the context)",
    )
    how.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    how.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    how.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    faults = parser.add_argument_group("fault injection")
    faults.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="MODE=RATE",
        help=f"repeatable; modes: {', '.join(FAULT_MODES)}",
    )
    faults.add_argument("--fault-seed", type=int, default=0)
    faults.add_argument("--hang-s", type=float, default=60.0)
    faults.add_argument("--retry-after-s", type=float, default=1.0)


def run(args: argparse.Namespace) -> int:
    if not args.echo and not args.model_path:
        raise SystemExit("eaglenest serve: give --model-path DIR, or --echo to serve without one")
    if args.echo and args.rule:
        raise SystemExit("eaglenest serve: --echo and --rule are two backends: give one")
    try:
        faults = FaultConfig(
            rates=parse_fault_specs(args.fault),
            seed=args.fault_seed,
            hang_s=args.hang_s,
            retry_after_s=args.retry_after_s,
        )
    except ValueError as error:
        raise SystemExit(f"eaglenest serve: {error}") from None
    model_name = args.served_model_name or (
        "echo" if args.echo else Path(args.model_path).resolve().name
    )
    backend: EchoBackend | ModelBackend | RuleBackend
    if args.echo:
        backend = EchoBackend(args.echo_latency_s, args.echo_latency_sigma)
    elif args.rule:
        try:
            backend = RuleBackend(
                args.model_path,
                tokenizer_path=args.tokenizer,
                trust_remote_code=args.trust_remote_code,
                max_model_len=args.max_model_len,
                default_max_tokens=args.default_max_tokens,
            )
        except ValueError as error:  # not a cite target: the message says what to set
            raise SystemExit(f"eaglenest serve: {error}") from None
    else:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        backend = ModelBackend(
            args.model_path,
            tokenizer_path=args.tokenizer,
            trust_remote_code=args.trust_remote_code,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.max_batch_size,
            gather_window_s=args.gather_window_s,
            max_model_len=args.max_model_len,
            default_max_tokens=args.default_max_tokens,
        )
    app = create_app(
        backend,
        model_name=model_name,
        dialect=args.dialect,
        faults=faults,
        token_ids=not args.no_token_ids,
    )
    log.info("serving %r, dialect %s, faults %s", model_name, args.dialect, dict(faults.rates))
    if isinstance(backend, ModelBackend):
        backend.start()
    try:
        asyncio.run(
            _serve(
                app,
                args.host,
                args.port,
                access_log=args.access_log,
                parent_pid=args.exit_with_parent,
            )
        )
    finally:
        if isinstance(backend, ModelBackend):
            backend.stop()
    return 0


async def _serve(
    app: web.Application, host: str, port: int, *, access_log: bool, parent_pid: int | None
) -> None:
    # A short shutdown timeout: handlers sleeping in an injected hang must not delay SIGTERM.
    runner = web.AppRunner(app, access_log=log if access_log else None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, shutdown_timeout=1.0)
    await site.start()
    bound_port = runner.addresses[0][1]
    url_host = f"[{host}]" if ":" in host else host
    print(f"{LISTENING_PREFIX}http://{url_host}:{bound_port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    watchdog = asyncio.create_task(_watch_parent(parent_pid, stop)) if parent_pid else None
    try:
        await stop.wait()
    finally:
        if watchdog is not None:
            watchdog.cancel()
        await runner.cleanup()
        log.info("stopped")


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    # An orphan is re-parented (to init or a subreaper), so its parent pid changes.
    while os.getppid() == parent_pid:
        await asyncio.sleep(1.0)
    log.warning("parent process %d is gone; stopping", parent_pid)
    stop.set()
