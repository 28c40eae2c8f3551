"""The capture pool's queue of waiting requests (capture/slot_queue.py), with slots as plain
numbers: first come first served, woken by a dispatch (a release) or the one scanner, which looks
only while something waits; a slot handed to a request cancelled meanwhile goes back; a failure
reaches every waiting request and every later one."""

from __future__ import annotations

import asyncio

import pytest

from eaglenest.capture.slot_queue import SlotQueue


class Slots:
    def __init__(self, free: int) -> None:
        self.free, self.looks, self.marks = free, 0, []

    def take(self) -> int | None:
        self.looks += 1
        if self.free:
            self.free -= 1
            return self.free
        return None

    def give_back(self, _slot: int) -> None:
        self.free += 1


def queue_of(slots: Slots, poll_s: float = 0.01) -> SlotQueue[int]:
    return SlotQueue(slots.take, slots.give_back, slots.marks.append, poll_s)


def test_waiting_requests_are_served_in_order_and_the_scanner_rests_while_none_waits():
    async def run():
        slots = Slots(1)
        queue = queue_of(slots)
        queue.start()
        assert await queue.get() == 0
        order: list[int] = []

        async def want(n: int) -> None:
            await queue.get()
            order.append(n)

        tasks = [asyncio.create_task(want(n)) for n in range(50)]
        await asyncio.sleep(0.1)  # about 10 scans while 50 wait
        assert order == [] and queue.scans <= 15, queue.scans
        for _ in range(50):
            slots.give_back(0)
            queue.dispatch()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == list(range(50))
        scans = queue.scans
        await asyncio.sleep(0.1)
        assert queue.scans == scans  # nothing waits: nothing is looked at
        await queue.close()
        return slots

    slots = asyncio.run(run())
    assert slots.marks[0] is True and slots.marks[-1] is False


def test_the_scanner_finds_a_slot_freed_elsewhere():
    async def run():
        slots = Slots(0)
        queue = queue_of(slots)
        queue.start()
        waiter = asyncio.create_task(queue.get())
        await asyncio.sleep(0.05)
        slots.free = 1  # another process released it: no dispatch here
        assert await asyncio.wait_for(waiter, 1) == 0
        await queue.close()

    asyncio.run(run())


def test_a_slot_handed_to_a_cancelled_request_goes_back():
    async def run():
        slots = Slots(0)
        queue = queue_of(slots, poll_s=10)
        waiter = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        slots.free = 1
        queue.dispatch()  # handed the slot...
        waiter.cancel()  # ...as it was cancelled
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert slots.free == 1 and not queue.waiters

    asyncio.run(run())


def test_a_failure_reaches_every_waiting_request_and_every_later_one():
    async def run():
        queue = queue_of(Slots(0), poll_s=10)
        waiters = [asyncio.create_task(queue.get()) for _ in range(3)]
        await asyncio.sleep(0)
        queue.fail(RuntimeError("no capture server answers"))
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert [str(r) for r in results] == ["no capture server answers"] * 3
        with pytest.raises(RuntimeError, match="no capture server answers"):
            await queue.get()

    asyncio.run(run())
