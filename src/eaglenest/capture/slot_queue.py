"""The capture pool's waiting requests (capture/pool.py): one queue, first come first served, that
hands each waiting request a server's slot as one frees, without any request polling.

Requests that find no free slot wait on a future of their own. What frees a slot wakes the queue:
this process's releases (at once), and ONE scanner per pool that looks every `poll_s` for what
this process cannot see happen (a slot another process of the host freed, a set-aside server back,
an overloaded server's backoff over), and only while something waits. So a request waiting costs
nothing, and hundreds waiting cost one look every `poll_s`, not one each (client/slots.py polled
per request: 512 waiting requests took 0.7 CPU-s every 2 s).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

Slot = TypeVar("Slot")


class SlotQueue(Generic[Slot]):
    """`await queue.get()`: a slot from `take()` (None when none is free now), in the order the
    requests came; `give_back(slot)` frees a slot handed to a request that left meanwhile.
    `mark_waiting(bool)` says whether requests wait (the host's older-jobs-first marks)."""

    def __init__(
        self,
        take: Callable[[], Slot | None],
        give_back: Callable[[Slot], None],
        mark_waiting: Callable[[bool], None],
        poll_s: float,
    ) -> None:
        self.take, self.give_back, self.mark_waiting = take, give_back, mark_waiting
        self.poll_s = poll_s
        self.waiters: deque[asyncio.Future] = deque()
        self.failure: BaseException | None = None
        self.scans = 0  # looks for free slots on behalf of the waiting requests
        self._waiting = asyncio.Event()  # set while a request waits: the scanner looks
        self._scanner: asyncio.Task | None = None

    def start(self) -> None:
        self._scanner = asyncio.create_task(self._scan())

    async def close(self) -> None:
        if self._scanner is not None:
            self._scanner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scanner

    async def get(self) -> Slot:
        """A slot: at once when one is free and no request waits before this one, else when one
        frees (or the failure that ended the waiting)."""
        if self.failure is not None:
            raise self.failure
        if not self.waiters:
            slot = self._take()
            if slot is not None:
                return slot
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        self._waiting.set()
        self.mark_waiting(True)
        try:
            return await waiter
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):
                self.waiters.remove(waiter)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.give_back(waiter.result())  # handed a slot as it was cancelled: the next's
                self.dispatch()
            self._idle()
            raise

    def _take(self) -> Slot | None:
        try:
            return self.take()
        except Exception as err:  # a lock error: every waiting request fails with it
            self.fail(err)
            raise

    def dispatch(self) -> None:
        """Hand free slots to the waiting requests, oldest first."""
        if not self.waiters:
            return
        self.scans += 1
        while self.waiters:
            if self.waiters[0].done():  # cancelled while it waited
                self.waiters.popleft()
                continue
            try:
                slot = self._take()
            except Exception:  # noqa: BLE001 (every waiting request raises it)
                return
            if slot is None:
                break
            self.waiters.popleft().set_result(slot)
        self._idle()

    def _idle(self) -> None:
        if not self.waiters:
            self._waiting.clear()
            self.mark_waiting(False)

    def fail(self, err: BaseException) -> None:
        """Every waiting request, and every later one, raises `err`."""
        self.failure = err
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(err)
        self._idle()

    async def _scan(self) -> None:
        while True:
            await self._waiting.wait()
            await asyncio.sleep(self.poll_s)
            self.dispatch()
