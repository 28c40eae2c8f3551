"""Stand-in capture servers for the capture pool's tests: real aiohttp servers on 127.0.0.1, each
in a thread with an event loop of its own (so a server can hang, stop and come back on its port
while the pool runs in the test's loop), answering as `eaglenest serve-capture`'s vLLM does: its
served name on /v1/models, and a completion whose `kv_transfer_params.hidden_states_path` names a
state file `<storage>/cmpl-<request id>-0-<n>.safetensors` with a `.lock` beside it.

What a server does is two handlers, `models` and `complete`, async functions of (request, server)
returning the response: the defaults answer rightly; the tests swap in ones that fail.
"""

from __future__ import annotations

import asyncio
import fcntl
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from aiohttp import web
from safetensors.torch import save_file

from support.servers import free_port

if TYPE_CHECKING:
    from typing_extensions import Self

MODEL = "eaglenest-capture-test"
PROMPT = np.arange(5, dtype=np.int64)
LAYERS, HIDDEN = 4, 2  # what the tests' state files hold: [T, LAYERS, HIDDEN]

Handler = Callable[[web.Request, "CaptureServer"], Awaitable[web.StreamResponse]]


def write_states(path: Path, ids, layers=LAYERS, hidden=HIDDEN, dtype=torch.float32, fill=1.0):
    """A state file as our connector writes it: `hidden_states` [T, layers, hidden] and
    `token_ids` [T]."""
    states = torch.full((len(ids), layers, hidden), fill).to(dtype)
    save_file({"hidden_states": states, "token_ids": torch.as_tensor(np.asarray(ids))}, path)


async def models_ok(_request: web.Request, _server: CaptureServer) -> web.Response:
    return web.json_response({"data": [{"id": MODEL}]})


async def complete_whole(request: web.Request, server: CaptureServer) -> web.Response:
    """The right answer: a whole state file, its lock free."""
    body, path = await server.take(request)
    write_states(path, body["prompt"])
    return server.answer(body, path)


class CaptureServer:
    """`with CaptureServer(storage) as server:` one stand-in server at `server.url`."""

    def __init__(
        self,
        storage: Path,
        complete: Handler = complete_whole,
        models: Handler = models_ok,
        port: int | None = None,
    ):
        self.storage, self.complete, self.models = storage, complete, models
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sent: list[str] = []  # request ids, in the order they came
        self.headers: list[str | None] = []  # each request's Authorization header, probes too
        self.held: list = []  # lock files held open (a hung writer)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # --- what handlers use ---------------------------------------------------------------

    async def take(self, request: web.Request) -> tuple[dict, Path]:
        """The request's body, and its state file's path, its lock created as vLLM does."""
        body = await request.json()
        self.sent.append(body["request_id"])
        path = self.storage / f"cmpl-{body['request_id']}-0-{len(self.sent):08x}.safetensors"
        Path(f"{path}.lock").touch()
        return body, path

    def answer(self, body: dict, path: Path | str) -> web.Response:
        return web.json_response({
            "choices": [{"prompt_token_ids": body["prompt"]}],
            "kv_transfer_params": {"hidden_states_path": str(path)},
        })  # fmt: skip

    def hold_lock(self, path: Path) -> None:
        """Hold `path`'s lock as a writer that hung after its answer (until the server stops)."""
        stream = open(f"{path}.lock")  # noqa: SIM115 (held open on purpose)
        fcntl.flock(stream, fcntl.LOCK_EX)
        self.held.append(stream)

    # --- running -------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(request.headers.get("Authorization"))
        return await self.models(request, self)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(request.headers.get("Authorization"))
        return await self.complete(request, self)

    async def _start(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/v1/models", self._models),
                        web.post("/v1/completions", self._complete)])  # fmt: skip
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def start(self) -> Self:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        """Stops answering (its port closed); `start()` again serves on the same port."""
        if self._loop is None:
            return
        runner = self._runner
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(timeout=10)
        self._loop.close()
        self._loop = self._runner = self._thread = None
        for stream in self.held:
            stream.close()
        self.held.clear()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()


def read_ids(path: str) -> list[int]:
    """A pool's `read`: the token ids of a state file, checked as the capture stage checks it."""
    from eaglenest.capture.answer import ExpectedStates, check_states
    from eaglenest.capture.state_file import read_request_file

    states = read_request_file(path)
    check_states(states, ExpectedStates(LAYERS, HIDDEN, torch.float32), PROMPT, path)
    return states["token_ids"].tolist()


def capture_with(
    urls: list[str], slots: Path, rows=(0,), wait_s=5.0, key_env=None, **pool_args
) -> tuple:
    """Capture PROMPT once per row through a pool of `urls` (`pool_args`: CapturePool's keyword
    arguments, its bounds and backoff): (each row's ids, the pool)."""
    from eaglenest.capture.pool import CapturePool

    async def capture():
        async with CapturePool(urls, MODEL, 1, wait_s, slots, key_env, **pool_args) as pool:
            ids = [await pool.capture(PROMPT, f"eaglenest-test-{row}", row, read_ids)
                   for row in rows]  # fmt: skip
            return ids, pool

    return asyncio.run(capture())
