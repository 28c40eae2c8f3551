"""Capture pool benchmark: the CPU-seconds that requests waiting for a capture server's slot cost.

A shard job keeps up to `vllm.requests_per_batch` requests in flight per server and the rest of its
samples wait in the pool (capture/pool.py) for a slot; slots are shared with every other job of
the host through lock files (client/slots.py). Waiting must cost nothing measurable however many
requests wait. Two cases, each for every `--waiting` N, on one stand-in server (aiohttp on
127.0.0.1, in a thread, answering /v1/models):

- held here: cap 1, one request of this process in flight (its answer delayed past the
  measurement), N requests waiting behind it;
- held elsewhere: cap 4, every slot held by another process (as other shard jobs of the host
  hold them), N requests waiting.

Figure: this process's CPU-seconds (time.process_time, every thread) over `--seconds` of waiting,
after the requests settled; before and after the waiting queue in bench/RESULTS.md (each request
polled every 10 ms before: 512 waiting took 0.5-0.7 CPU-s every 2 s; now ~0.02, whatever N).

Usage: python bench/capture_waiting.py [--waiting 64 512] [--seconds 2] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from aiohttp import web

from eaglenest.capture.pool import CapturePool

MODEL = "eaglenest-capture-bench"
SETTLE_S = 0.5  # for the requests to reach their wait before the measurement starts
HOLDER = """
import sys, time
from pathlib import Path
from eaglenest.client.slots import EndpointSlots
from eaglenest.settings.urls import api_base
slots = EndpointSlots(api_base(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
held = [slots.try_acquire() for _ in range(int(sys.argv[2]))]
assert None not in held, held
print("held", flush=True)
time.sleep(3600)
"""


class StandInServer:
    """A server that lists MODEL and answers completions only after `hold_s` (never, here)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.done = asyncio.Event()  # set when the bench ends: the held answers end too
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL}]})

    async def _complete(self, _request: web.Request) -> web.Response:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.done.wait(), self.hold_s)
        return web.Response(status=500, text="the bench never answers")

    async def _start(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/v1/models", self._models),
                        web.post("/v1/completions", self._complete)])  # fmt: skip
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> StandInServer:  # noqa: PYI034
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        return self

    def __exit__(self, *_exc) -> None:
        assert self.runner is not None
        self.loop.call_soon_threadsafe(self.done.set)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def waiting_cpu_s(url: str, cap: int, requests: int, seconds: float, slots: Path) -> float:
    """CPU-seconds of this process over `seconds` while `requests` captures wait in a pool."""
    prompt = np.arange(4, dtype=np.int64)
    async with CapturePool([url], MODEL, cap, 600.0, slots) as pool:
        tasks = [
            asyncio.create_task(pool.capture(prompt, f"eaglenest-bench-{i}", i, lambda _p: None))
            for i in range(requests)
        ]
        await asyncio.sleep(SETTLE_S)
        started = time.process_time()
        await asyncio.sleep(seconds)
        spent = time.process_time() - started
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return spent


def held_here(waiting: int, seconds: float) -> float:
    with StandInServer(hold_s=3600) as server, tempfile.TemporaryDirectory() as tmp:
        slots = Path(tmp) / "slots"
        return asyncio.run(waiting_cpu_s(server.url, 1, waiting + 1, seconds, slots))


def held_elsewhere(waiting: int, seconds: float) -> float:
    cap = 4
    with StandInServer(hold_s=3600) as server, tempfile.TemporaryDirectory() as tmp:
        slots = Path(tmp) / "slots"
        slots.mkdir(mode=0o700)
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, server.url, str(cap), str(slots)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            return asyncio.run(waiting_cpu_s(server.url, cap, waiting, seconds, slots))
        finally:
            holder.kill()
            holder.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waiting", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--seconds", type=float, default=2.0, help="of waiting, measured")
    parser.add_argument("--quick", action="store_true", help="64 waiting, 1 s")
    parser.add_argument("--json", type=Path, help="write the figures here as one JSON object")
    args = parser.parse_args()
    if args.quick:
        args.waiting, args.seconds = [64], 1.0
    figures: dict = {"seconds": args.seconds, "cases": []}
    print(f"CPU-seconds over {args.seconds:g} s of waiting")
    for waiting in args.waiting:
        for case, measure in (("held here", held_here), ("held elsewhere", held_elsewhere)):
            cpu_s = measure(waiting, args.seconds)
            figures["cases"].append({"case": case, "waiting": waiting, "cpu_s": round(cpu_s, 3)})
            print(f"  {waiting:5d} waiting, slots {case:15s} {cpu_s:6.3f} CPU-s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
