"""The run's capture servers as one pool (`vllm.capture_urls`, one `eaglenest serve-capture` a
node): ask it for one sample's states and it sends the request to a server that answers, under
that server's cap, and hands back the state file the server wrote.

Each server has its own cap (`vllm.requests_per_batch` slots over every job of the host,
client/slots.py, as generation's endpoints): a request takes a free slot on the least-loaded server
that answers, and holds it until its file is packed and deleted, so a server never has more than
its cap of files on disk. Every server is checked before the first request: one that serves
another name (another target, dtype, engine arguments or aux layers) fails the job at once.

A server that stops answering (connection refused or dropped, a request timed out) is set aside:
the requests it had in flight are sent to the others, and it is asked again every PROBE_S; once it
answers with the right name it takes requests again. When no server answers, the requests wait,
for `vllm.capture_wait_s` after the last one went quiet, then the job fails naming the URLs (as
generation benches an endpoint that fails, client/pool.py, but here a server is expected back:
restarted, or its node replaced). A server's answer with a retryable HTTP status is retried,
on any server, at most ATTEMPTS times a sample; a sample dropped MOVES_MAX times fails the job.

Training without stored states (hidden.store none/budget) asks the same pool for a batch's states:
`capture(prompt, request_id, row, read)` is the one call it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aiohttp
import numpy as np

from eaglenest.capture.state_file import StateFileLost, remove_state_file
from eaglenest.client.retry import RETRYABLE_STATUS, RetryPolicy
from eaglenest.client.slots import POLL_S, EndpointSlots
from eaglenest.settings.urls import api_base, endpoint_path, redacted_url

log = logging.getLogger(__name__)
T = TypeVar("T")

# Per sample: a server restarting between shards is not a reason to fail a shard (client/retry.py).
CAPTURE_RETRY = RetryPolicy(max_attempts=3, backoff_base_s=1.0, backoff_max_s=4.0)
REQUEST_TIMEOUT_S = 600  # one prompt's forward pass; a 32K-token sample takes seconds on a GPU
PROBE_S = 2.0  # how often a server that stopped answering is asked again
# Sends of one sample to servers that dropped it: past this, servers that answer the probe but
# drop every request (a crash each time) fail the job instead of taking the sample forever.
MOVES_MAX = 10
# Raised by a request to a server that does not answer; its request goes to another server.
# A server gone: no connection, no answer in time, or an answer cut short (killed while it sent
# it: "Response payload is not completed"): its request goes to another server.
GONE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


class CaptureServerError(RuntimeError):
    """No capture server answers, one serves another capture, or one answered wrongly."""


@dataclass
class CaptureServer:
    url: str
    slots: EndpointSlots
    in_flight: int = 0  # this process's requests holding one of its slots
    down_since: float | None = None  # when it stopped answering; None while it answers
    answered: int = 0
    moved: int = 0  # requests sent to it that went to another server instead

    @property
    def name(self) -> str:
        return redacted_url(self.url)


def answered_path(answer: dict, sent: np.ndarray, row: int) -> str:
    """The state file of an answer, once its prompt ids are checked against those sent."""
    choices = answer.get("choices") or [{}]
    returned = choices[0].get("prompt_token_ids")
    if returned is None:
        returned = answer.get("prompt_token_ids")
    if returned is not None and list(returned) != sent.tolist():
        raise CaptureServerError(
            f"sample row {row}: the server ran other prompt ids than were sent "
            f"({len(returned)} vs {len(sent)} tokens)"
        )
    path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise CaptureServerError(
            f"sample row {row}: the answer has no kv_transfer_params.hidden_states_path: the "
            "server is not a capture server (extract_hidden_states and a KV connector)"
        )
    return path


class CapturePool:
    """`async with CapturePool(...) as pool:` then `await pool.capture(..., read)`."""

    def __init__(
        self,
        urls: list[str] | tuple[str, ...],
        model: str,
        cap: int,
        wait_s: float,
        slots_dir: Path | None = None,
    ) -> None:
        if not urls:
            raise ValueError("a capture pool needs at least one URL (vllm.capture_urls)")
        self.urls, self.model, self.cap, self.wait_s = list(urls), model, cap, wait_s
        self.slots_dir = slots_dir
        self.servers: list[CaptureServer] = []
        self.failure: BaseException | None = None
        self._wanting = 0
        self._session: aiohttp.ClientSession | None = None
        self._watcher: asyncio.Task | None = None

    async def __aenter__(self) -> CapturePool:  # noqa: PYI034
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, connect=10)
        connector = aiohttp.TCPConnector(limit=self.cap * len(self.urls) + 1, limit_per_host=0)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        try:
            for url in self.urls:
                slots = EndpointSlots(api_base(url), self.cap, self.slots_dir)
                self.servers.append(CaptureServer(url, slots))
            for server in self.servers:
                problem = await self._problem(server)
                if problem:
                    self._set_down(server, problem)
        except BaseException:
            await self._close()
            raise
        self._watcher = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *_exc) -> None:
        await self._close()

    async def _close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        for server in self.servers:
            server.slots.close()
        if self._session is not None:
            await self._session.close()

    # --- which servers answer --------------------------------------------------------------

    async def _problem(self, server: CaptureServer) -> str | None:
        """None when `server` answers with this run's name; why not otherwise. A server that
        serves another name is an error: its states would be another capture's."""
        assert self._session is not None
        try:
            async with self._session.get(
                endpoint_path(api_base(server.url), "/v1/models"),
                timeout=aiohttp.ClientTimeout(total=10),
            ) as response:
                body = await response.json(content_type=None)
        except (*GONE, ValueError) as err:
            return f"{type(err).__name__}: {err}"
        served = [m.get("id") for m in (body or {}).get("data") or []]
        if self.model not in served:
            raise CaptureServerError(
                f"vllm.capture_urls: {server.name} serves {served}, not {self.model}: it was "
                "started for another target, dtype, engine arguments or aux layers than this "
                "run's; start `eaglenest serve-capture` with this run's config"
            )
        return None

    def _set_down(self, server: CaptureServer, why: str) -> None:
        if server.down_since is None:
            server.down_since = time.monotonic()
            others = sum(s.down_since is None for s in self.servers)
            log.warning(
                "capture server %s does not answer (%s); %d other(s) answer%s",
                *(server.name, why, others, "" if others else f": waiting {self.wait_s:.0f} s"),
            )

    async def _watch(self) -> None:
        """Ask the servers that stopped answering again; fail the pool when none has answered
        for wait_s."""
        while True:
            await asyncio.sleep(PROBE_S)
            for server in self.servers:
                if server.down_since is None:
                    continue
                try:
                    problem = await self._problem(server)
                except CaptureServerError as err:
                    self.failure = err
                    return
                if problem is None:
                    log.info("capture server %s answers again", server.name)
                    server.down_since = None
            downs = [s.down_since for s in self.servers]
            if all(d is not None for d in downs):
                quiet_s = time.monotonic() - max(d for d in downs if d is not None)
                if quiet_s > self.wait_s:
                    self.failure = CaptureServerError(
                        "no capture server answers (vllm.capture_urls: "
                        f"{', '.join(s.name for s in self.servers)}) after waiting "
                        f"{self.wait_s:.0f} s (vllm.capture_wait_s) for one to come back; start "
                        "them with `eaglenest serve-capture` and this run's config"
                    )
                    return

    # --- requests ----------------------------------------------------------------------------

    async def _acquire(self) -> tuple[CaptureServer, int]:
        """A slot on the least-loaded server that answers; older jobs (earlier shards) first."""
        self._wanting += 1
        try:
            while True:
                if self.failure is not None:
                    raise self.failure
                up = [s for s in self.servers if s.down_since is None]
                for server in sorted(up, key=lambda s: s.in_flight):
                    index = server.slots.try_acquire()
                    if index is not None:
                        server.in_flight += 1
                        return server, index
                for server in self.servers:
                    server.slots.set_waiting(server.down_since is None)
                await asyncio.sleep(POLL_S)
        finally:
            self._wanting -= 1
            if not self._wanting:
                for server in self.servers:
                    server.slots.set_waiting(False)

    def _release(self, server: CaptureServer, index: int) -> None:
        server.in_flight -= 1
        server.slots.release(index)

    async def _post(self, server: CaptureServer, prompt: np.ndarray, request_id: str) -> tuple:
        """(HTTP status, body) of one completion request for `prompt`'s states."""
        assert self._session is not None
        body = {
            "model": self.model,
            "prompt": prompt.tolist(),
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
            "request_id": request_id,
        }
        url = endpoint_path(api_base(server.url), "/v1/completions")
        async with self._session.post(url, json=body) as response:
            return response.status, await response.text()

    async def capture(
        self, prompt: np.ndarray, request_id: str, row: int, read: Callable[[str], T]
    ) -> T:
        """`read(path)` (run in a thread) of the state file that `prompt`'s states were written
        to by whichever server answered, its answer checked; the server's slot is held while it
        reads, and the file is removed after. A server that ends between its answer and its
        file (read raises StateFileLost) has dropped the sample: it goes to another server."""
        retried = 0
        for sent in range(1, 1_000_000):
            server, index = await self._acquire()
            try:
                status, text = await self._post(server, prompt, f"{request_id}-{sent}")
            except GONE as err:
                self._release(server, index)
                self._dropped(server, sent - retried, row, f"{type(err).__name__}: {err}")
                continue
            if status != 200:
                self._release(server, index)
                retried += 1
                if status not in RETRYABLE_STATUS or not CAPTURE_RETRY.retries(retried):
                    raise CaptureServerError(
                        f"sample row {row}: {server.name} answered HTTP {status}: {text[:500]}"
                    )
                await asyncio.sleep(CAPTURE_RETRY.backoff_s(retried))
                continue
            path = None
            try:
                path = answered_path(json.loads(text), prompt, row)
                result = await asyncio.to_thread(read, path)
            except StateFileLost as err:
                self._dropped(server, sent - retried, row, str(err))
                continue
            finally:
                if path is not None:
                    remove_state_file(path)  # read or not: a failed job leaves no file
                self._release(server, index)
            server.answered += 1
            return result
        raise AssertionError("unreachable")

    def _dropped(self, server: CaptureServer, drops: int, row: int, why: str) -> None:
        """`server` lost a sample it was sent (its `drops`th loss): set aside, or the job fails
        once the sample was lost MOVES_MAX times."""
        server.moved += 1
        self._set_down(server, why)
        if drops >= MOVES_MAX:
            raise CaptureServerError(
                f"sample row {row}: sent {drops} times to servers that dropped it (the last: "
                f"{server.name}, {why})"
            )

    def summary(self) -> str:
        return "; ".join(
            f"{s.name}: {s.answered} answered, {s.moved} moved to others" for s in self.servers
        )
