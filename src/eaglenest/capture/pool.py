"""The run's capture servers as one pool (`vllm.capture_urls`, one `eaglenest serve-capture` a
node): ask it for one sample's states and it sends the request to a server that answers, under
that server's cap, and hands back the state file the server wrote.

Each server has its own cap (`vllm.requests_per_batch` slots over every job of the host,
client/slots.py, as generation's endpoints): a request takes a free slot on the least-loaded server
that answers, and holds it until its file is packed and deleted, so a server never has more than
its cap of files on disk. Requests that find no free slot wait in one queue, first come first
served (capture/slot_queue.py), woken by this process's releases and by one scanner per pool that
looks for slots other processes freed: waiting costs nothing, however many wait. Every server is
checked before the first request: one that serves another name (another target, dtype, engine
arguments or aux layers) fails the job at once. With `vllm.capture_key_env`, every request and
probe carries the servers' key (`Authorization: Bearer`, as vLLM's `--api-key` demands it); the
key is never logged, and a 401 or 403 fails the job saying "authentication".

Every failure of a server's is the server's, not the sample's (capture/faults.py): no connection
or a dropped one, no answer in time, a 5xx, an answer that is not a completion, a state file
lost, torn, hung (its lock held past `vllm.capture_lock_wait_s`) or of the wrong shape, dtype or
values (answer.check_states). That server is set aside: the sample goes to another server, and
the server is asked again every PROBE_S; once it answers with the right name it takes requests
again. A sample is sent at most `vllm.capture_moves_max` times, then the job fails naming it and
the last failure. Overload (503, 429: a busy server; 502, 504: a gateway before one) is not a
failure of the server's: the server is backed off (exponential with jitter, its `Retry-After`
honoured, capped: OVERLOAD_BACKOFF) and asked again, and the sample's send counts as a move only
when another server served meanwhile. Any other 4xx fails the job at once (another server would
refuse it too). When no server serves, down or overloaded, the requests wait for
`vllm.capture_wait_s` after the last one went quiet, then the job fails naming the URLs and what
each last answered (as generation benches an endpoint that fails, client/pool.py, but here a
server is expected back: restarted, or its node replaced). Every wait is bounded: requests
(`vllm.capture_request_timeout_s`), probes (PROBE_TIMEOUT_S), state files' locks; and whatever
error the background prober meets becomes the pool's failure, never a prober dead while the
requests wait.

Training without stored states (hidden.store none/budget) asks the same pool for a batch's states:
`capture(prompt, request_id, row, read)` is the one call it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aiohttp
import numpy as np

from eaglenest.capture import state_file
from eaglenest.capture.faults import (
    AUTH_STATUS,
    OVERLOAD_NAMES,
    CaptureServerError,
    ServerBusy,
    ServerFault,
    answered_path,
    authentication_error,
    completion,
    served_models,
    status_fault,
)
from eaglenest.capture.key import capture_key
from eaglenest.capture.slot_queue import SlotQueue
from eaglenest.capture.state_file import remove_state_file, wait_written
from eaglenest.client.credentials import auth_headers, redact, url_secrets
from eaglenest.client.retry import RetryPolicy, retry_after_s
from eaglenest.client.slots import POLL_S, EndpointSlots
from eaglenest.settings.urls import api_base, endpoint_path, redacted_url

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["CapturePool", "CaptureServerError"]

# vllm.capture_request_timeout_s's default: one prompt's forward pass; a 32K-token sample takes
# seconds on a GPU.
REQUEST_TIMEOUT_S = 600
PROBE_TIMEOUT_S = 10.0  # a /v1/models answer; a server busy with a batch answers within it
PROBE_S = 2.0  # how often a server that stopped answering is asked again
# Sends of one sample (vllm.capture_moves_max's default): past this, servers that answer the probe
# but fail every request (a crash each time, a 500 for this prompt) fail the job instead of taking
# the sample forever.
MOVES_MAX = 10
# An overloaded server (faults.OVERLOAD_STATUS) is asked again after this: from 1 s, doubling, at most 30 s, and
# never sooner than its Retry-After (up to 2 minutes: one odd header must not park the pool).
OVERLOAD_BACKOFF = RetryPolicy(
    max_attempts=0, backoff_base_s=1.0, backoff_max_s=30.0, retry_after_max_s=120.0
)
# A server gone: no connection, no answer in time, an answer cut short (killed while it sent it:
# "Response payload is not completed") or not HTTP: its request goes to another server.
GONE = (aiohttp.ClientError, asyncio.TimeoutError)


def described(err: BaseException) -> str:
    """An error as a message quotes it: its type, and its text when it has one."""
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


@dataclass
class CaptureServer:
    url: str
    slots: EndpointSlots
    in_flight: int = 0  # this process's requests holding one of its slots
    down_since: float | None = None  # when it stopped answering; None while it answers
    busy_since: float | None = None  # its first overload answer since it last served
    busy_until: float = 0.0  # backed off until then (time.monotonic)
    busy_streak: int = 0  # backoffs since it last served: the next is longer
    answered: int = 0
    moved: int = 0  # requests sent to it that went to another server instead
    fault: str | None = None  # what it last answered wrongly to a request
    problem: str | None = None  # why it last did not answer a probe

    @property
    def name(self) -> str:
        return redacted_url(self.url)

    @property
    def quiet_since(self) -> float | None:
        """Since when it has served nothing, down or overloaded; None while it serves."""
        return self.down_since if self.down_since is not None else self.busy_since

    def last_said(self) -> str:
        """What it last answered wrongly (its probe's, while set aside, then a request's), for
        the message of a pool that gives up on it."""
        said = [self.problem] if self.down_since is not None and self.problem else []
        said += [self.fault] if self.fault and self.fault != self.problem else []
        return "; before that, to a request: ".join(said) or "nothing wrong yet"


class CapturePool:
    """`async with CapturePool(...) as pool:` then `await pool.capture(..., read)`. The bounds a
    slow cluster tunes are `vllm.capture_*` keys (settings/vllm.py's VllmRuntime); None takes
    this module's default (state_file.LOCK_WAIT_S for `lock_wait_s`)."""

    def __init__(
        self,
        urls: list[str] | tuple[str, ...],
        model: str,
        cap: int,
        wait_s: float,
        slots_dir: Path | None = None,
        key_env: str | None = None,
        *,
        request_timeout_s: float | None = None,
        lock_wait_s: float | None = None,
        moves_max: int | None = None,
        backoff: RetryPolicy = OVERLOAD_BACKOFF,
    ) -> None:
        if not urls:
            raise ValueError("a capture pool needs at least one URL (vllm.capture_urls)")
        if not (math.isfinite(wait_s) and wait_s >= 0):
            raise ValueError(f"vllm.capture_wait_s must be a finite number >= 0, not {wait_s}")
        self.urls, self.model, self.cap, self.wait_s = list(urls), model, cap, wait_s
        self.slots_dir, self.key_env = slots_dir, key_env
        self.request_timeout_s = request_timeout_s or REQUEST_TIMEOUT_S
        self.lock_wait_s = state_file.LOCK_WAIT_S if lock_wait_s is None else lock_wait_s
        self.moves_max = moves_max or MOVES_MAX
        self.backoff = backoff
        self._key = capture_key(key_env)
        # What no log or error may show: the key, and each URL's user info and query values.
        self._secrets = [self._key, *(secret for url in self.urls for secret in url_secrets(url))]
        self.servers: list[CaptureServer] = []
        self.failure: BaseException | None = None
        self.served = 0  # samples served, by every server
        self._session: aiohttp.ClientSession | None = None
        self._watcher: asyncio.Task | None = None
        self.queue: SlotQueue[tuple[CaptureServer, int]] | None = None

    async def __aenter__(self) -> CapturePool:  # noqa: PYI034
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, connect=10)
        connector = aiohttp.TCPConnector(limit=self.cap * len(self.urls) + 1, limit_per_host=0)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=connector, headers=auth_headers(self._key)
        )
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
        self.queue = SlotQueue(self._take, self._give_back, self._mark_waiting, POLL_S)
        self.queue.start()
        self._watcher = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *_exc) -> None:
        await self._close()

    async def _close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self.queue is not None:
            await self.queue.close()
        for server in self.servers:
            server.slots.close()
        if self._session is not None:
            await self._session.close()

    async def _text(self, response: aiohttp.ClientResponse) -> str:
        """A server's answer as text, whatever its bytes, and without credentials (an error may
        quote the key, and a proxy may echo the request: its URL, its Authorization header)."""
        return redact((await response.read()).decode("utf-8", "replace"), self._secrets)

    def _described(self, err: BaseException) -> str:
        """A client error as a message quotes it, without credentials (one may quote the URL)."""
        return redact(described(err), self._secrets)

    # --- which servers answer --------------------------------------------------------------

    async def _problem(self, server: CaptureServer) -> str | None:
        """None when `server` answers with this run's name; why not otherwise. A server that
        serves another name, or refuses the key, is an error: its states would be another
        capture's, and another try would be refused alike."""
        assert self._session is not None
        try:
            async with self._session.get(
                endpoint_path(api_base(server.url), "/v1/models"),
                timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S),
            ) as response:
                status, body = response.status, await self._text(response)
        except GONE as err:
            return f"does not answer ({self._described(err)})"
        if status in AUTH_STATUS:
            raise authentication_error(server.name, status, self.key_env)
        try:
            served = served_models(status, body)
        except ServerFault as fault:
            return str(fault)
        if self.model not in served:
            raise CaptureServerError(
                f"vllm.capture_urls: {server.name} serves {served}, not {self.model}: it was "
                "started for another target, dtype, engine arguments or aux layers than this "
                "run's; start `eaglenest serve-capture` with this run's config"
            )
        return None

    def _set_down(self, server: CaptureServer, why: str) -> None:
        server.problem = why
        if server.down_since is None:
            server.down_since = time.monotonic()
            others = sum(s.down_since is None for s in self.servers)
            log.warning(
                "capture server %s set aside: %s; %d other(s) answer%s",
                *(server.name, why, others, "" if others else f": waiting {self.wait_s:g} s"),
            )

    async def _watch(self) -> None:
        """Ask the servers that stopped answering again; fail the pool when none has served
        for wait_s. Whatever error it meets fails the pool: the requests would otherwise wait
        for a prober that is no more."""
        try:
            while True:
                await asyncio.sleep(PROBE_S)
                await self._probe_down()
                self._check_quiet()
        except asyncio.CancelledError:
            raise
        except CaptureServerError as err:
            self._fail(err)
        except Exception as err:  # noqa: BLE001 (becomes the failure every request raises)
            failure = CaptureServerError(
                f"the capture pool's prober failed ({self._described(err)}); servers: "
                + ", ".join(s.name for s in self.servers)
            )
            failure.__cause__ = err
            self._fail(failure)

    def _fail(self, failure: BaseException) -> None:
        self.failure = failure
        if self.queue is not None:
            self.queue.fail(failure)

    async def _probe_down(self) -> None:
        for server in self.servers:
            if server.down_since is not None:
                problem = await self._problem(server)
                if problem is None:
                    log.info("capture server %s answers again", server.name)
                    server.down_since = server.problem = None
                else:
                    server.problem = problem

    def _check_quiet(self) -> None:
        quiet = [s.quiet_since for s in self.servers]
        if any(since is None for since in quiet):
            return
        quiet_s = time.monotonic() - max(since for since in quiet if since is not None)
        if quiet_s <= self.wait_s:
            return
        busy = any(s.down_since is None for s in self.servers)
        fix = (
            f"they are overloaded (HTTP {OVERLOAD_NAMES}): give them fewer jobs at once, more servers, or "
            "a longer vllm.capture_wait_s"
            if busy
            else "start them with `eaglenest serve-capture` and this run's config"
        )
        raise CaptureServerError(
            "no capture server answers (vllm.capture_urls: "
            f"{', '.join(s.name for s in self.servers)}) after waiting {self.wait_s:g} s "
            f"(vllm.capture_wait_s) for one to come back; {fix}. What each last answered: "
            + "; ".join(f"{s.name}: {s.last_said()}" for s in self.servers)
        )

    # --- requests ----------------------------------------------------------------------------

    def _take(self) -> tuple[CaptureServer, int] | None:
        """A free slot now on the least-loaded server that answers and is not backed off."""
        now = time.monotonic()
        ready = [s for s in self.servers if s.down_since is None and s.busy_until <= now]
        for server in sorted(ready, key=lambda s: s.in_flight):
            index = server.slots.try_acquire()
            if index is not None:
                server.in_flight += 1
                return server, index
        return None

    def _give_back(self, slot: tuple[CaptureServer, int]) -> None:
        server, index = slot
        server.in_flight -= 1
        server.slots.release(index)

    def _mark_waiting(self, waiting: bool) -> None:
        """Older jobs first (client/slots.py): say, on each server that answers, that requests
        of this process wait."""
        for server in self.servers:
            server.slots.set_waiting(waiting and server.down_since is None)

    async def _acquire(self) -> tuple[CaptureServer, int]:
        """A slot on the least-loaded server that answers; older jobs (earlier shards), then
        older requests, first."""
        if self.failure is not None:
            raise self.failure
        assert self.queue is not None
        return await self.queue.get()

    def _release(self, server: CaptureServer, index: int) -> None:
        self._give_back((server, index))
        assert self.queue is not None
        self.queue.dispatch()  # the freed slot goes to the oldest waiting request, now

    async def _answer(self, server: CaptureServer, prompt: np.ndarray, sent_id: str, row: int):
        """The state file `server` names for `prompt`'s states, its answer checked
        (capture/faults.py): ServerFault for what another server may answer right."""
        assert self._session is not None
        body = {
            "model": self.model,
            "prompt": prompt.tolist(),
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
            "request_id": sent_id,
        }
        url = endpoint_path(api_base(server.url), "/v1/completions")
        try:
            async with self._session.post(url, json=body) as response:
                status, text = response.status, await self._text(response)
                wait_s = retry_after_s(response.headers.get("Retry-After"))
        except GONE as err:
            raise ServerFault(f"does not answer ({self._described(err)})") from None
        if status != 200:
            raise status_fault(status, text, server.name, row, self.key_env, wait_s)
        who = f"sample row {row}: capture server {server.name}"
        return answered_path(completion(text), prompt, sent_id, who)

    def _read(self, read: Callable[[str], T], path: str) -> T:
        """`read(path)` once the server has written the file (its lock waited for, at most
        lock_wait_s: StateFileHung past it)."""
        wait_written(path, self.lock_wait_s)
        return read(path)

    async def capture(
        self, prompt: np.ndarray, request_id: str, row: int, read: Callable[[str], T]
    ) -> T:
        """`read(path)` (run in a thread) of the state file that `prompt`'s states were written
        to by whichever server answered, its answer checked; the server's slot is held while it
        reads, and the file is removed after. A server that fails the sample (its answer, or
        `read` raising a ServerFault: the file lost, hung or wrong) is set aside and the sample
        goes to another; an overloaded one is backed off and asked again."""
        moves = 0
        for sent in itertools.count(1):
            server, index = await self._acquire()
            served_elsewhere = self.served - server.answered
            path = None
            try:
                path = await self._answer(server, prompt, f"{request_id}-{sent}", row)
                result = await asyncio.to_thread(self._read, read, path)
            except ServerFault as fault:
                # Overload everywhere is waiting, not the sample's fault: it counts only when
                # another server served meanwhile.
                other_served = self.served - server.answered > served_elsewhere
                if not isinstance(fault, ServerBusy) or other_served:
                    moves += 1
                self._failed(server, sent, moves, row, fault)
                continue
            finally:
                if path is not None:
                    remove_state_file(path)  # read or not: a failed job leaves no file
                self._release(server, index)
            server.answered += 1
            self.served += 1
            server.busy_since, server.busy_streak, server.fault = None, 0, None
            return result
        raise AssertionError("unreachable")

    def _failed(
        self, server: CaptureServer, sent: int, moves: int, row: int, fault: ServerFault
    ) -> None:
        """`server` failed a sample it was sent (its `sent`th send, the `moves`th that counts):
        set aside, or backed off when overloaded; the job fails once the sample moved
        moves_max times."""
        server.moved += 1
        server.fault = f"sample row {row}: {fault}"
        if isinstance(fault, ServerBusy):
            self._back_off(server, fault)
        else:
            self._set_down(server, server.fault)
        if moves >= self.moves_max:
            raise CaptureServerError(
                f"sample row {row}: sent {sent} times to servers that failed it ({moves} moves "
                f"count, vllm.capture_moves_max {self.moves_max}; the last: {server.name}: "
                f"{fault})"
            )

    def _back_off(self, server: CaptureServer, fault: ServerBusy) -> None:
        """An overloaded server is asked again after a backoff that grows while it stays so;
        the answers of requests sent before the backoff began do not grow it."""
        now = time.monotonic()
        if server.busy_since is None:
            server.busy_since = now
        if now < server.busy_until:
            return
        server.busy_streak += 1
        wait_s = self.backoff.backoff_s(server.busy_streak, fault.retry_after_s)
        server.busy_until = now + wait_s
        log.warning(
            "capture server %s is overloaded (%s): asked again in %.1f s",
            *(server.name, str(fault)[:200], wait_s),
        )

    def summary(self) -> str:
        return "; ".join(
            f"{s.name}: {s.answered} answered, {s.moved} moved to others" for s in self.servers
        )
