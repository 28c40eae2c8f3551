"""Overload and waiting in the capture pool (capture/pool.py, capture/slot_queue.py): servers that
all answer 503 or 429 (a busy cluster), or 502 or 504 (a gateway before one), are backed off and
waited for within `capture_wait_s`, as servers that are down are, and the job completes once they serve; past that
bound it fails naming the status; a `Retry-After` is honoured; a send counts as a move only when
another server served meanwhile. Requests waiting for a slot are served in the order they came,
woken by releases and one scanner per pool, not each polling. The final error names what each
server last answered (garbage included). Stand-in servers on 127.0.0.1
(tests/support/capture_servers.py); short waits and backoffs through the pool's arguments."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from support.capture_servers import (
    MODEL,
    PROMPT,
    CaptureServer,
    capture_with,
    complete_whole,
    models_ok,
    read_ids,
)

from eaglenest.capture import pool as capture_pool
from eaglenest.capture.pool import CapturePool, CaptureServerError
from eaglenest.client.retry import RetryPolicy
from eaglenest.client.slots import POLL_S

QUICK_BACKOFF = RetryPolicy(
    max_attempts=0, backoff_base_s=0.02, backoff_max_s=0.1, retry_after_max_s=5
)


@pytest.fixture(autouse=True)
def quick_probes(monkeypatch):
    monkeypatch.setattr(capture_pool, "PROBE_S", 0.05)


def overloaded_for(seconds: float, status: int = 503, headers: dict | None = None):
    """Answers `status` for `seconds` after its first request, then serves."""
    first: list[float] = []

    async def complete(request, server):
        first.append(time.monotonic())
        if time.monotonic() - first[0] < seconds:
            await server.take(request)
            return web.Response(status=status, text="Service Unavailable", headers=headers)
        return await complete_whole(request, server)

    return complete


def test_servers_all_overloaded_for_a_while_are_waited_for_and_the_job_completes(tmp_path):
    """Every server 503 for 1.5 s, then serving: the job completes (it failed after 8-18 s of
    MOVES_MAX sends, while a server down is waited for capture_wait_s); the sends during the
    overload do not count as moves, however many (moves_max 2 here)."""
    started = time.monotonic()
    with (
        CaptureServer(tmp_path, overloaded_for(1.5)) as first,
        CaptureServer(tmp_path, overloaded_for(1.5)) as second,
    ):
        ids, pool = capture_with(
            [first.url, second.url], tmp_path, rows=[0, 1], wait_s=5.0,
            moves_max=2, backoff=QUICK_BACKOFF,
        )  # fmt: skip
    assert ids == [[0, 1, 2, 3, 4]] * 2
    assert len(first.sent) + len(second.sent) > 2 + 2  # each sample sent more than moves_max
    assert 1.5 <= time.monotonic() - started < 5
    assert sum(s.answered for s in pool.servers) == 2
    assert all(s.down_since is None for s in pool.servers)  # backed off, never set aside


@pytest.mark.parametrize("status", [502, 504])
def test_a_gateways_502_or_504_burst_is_waited_out_like_an_overload(tmp_path, status):
    """A capture server behind an ingress answers 502/504 while it is busy: the job failed in
    18 s (each answer set the server aside and counted as a move); it is waited out within
    capture_wait_s as 503/429 are, never set aside, the sends not counted as moves."""
    with CaptureServer(tmp_path, overloaded_for(1.0, status)) as server:
        ids, pool = capture_with(
            [server.url], tmp_path, rows=[0], wait_s=5.0, moves_max=1, backoff=QUICK_BACKOFF
        )
    assert ids == [[0, 1, 2, 3, 4]]
    assert len(server.sent) > 2  # asked again and again, more than moves_max sends
    assert pool.servers[0].down_since is None


@pytest.mark.parametrize("status", [503, 429, 502, 504])
def test_overload_past_capture_wait_s_fails_at_that_bound_naming_the_status(tmp_path, status):
    started = time.monotonic()
    with (
        CaptureServer(tmp_path, overloaded_for(60, status)) as server,
        pytest.raises(CaptureServerError) as failure,
    ):
        capture_with([server.url], tmp_path, rows=[3], wait_s=1.0, backoff=QUICK_BACKOFF)
    waited = time.monotonic() - started
    message = str(failure.value)
    assert 1.0 <= waited < 3, waited
    assert message.startswith(f"no capture server answers (vllm.capture_urls: {server.url})")
    assert "after waiting 1 s (vllm.capture_wait_s)" in message
    assert "they are overloaded (HTTP 429/502/503/504)" in message
    assert f"{server.url}: sample row 3: HTTP {status}: Service Unavailable" in message
    assert len(server.sent) > 3  # asked again and again while it waited


def test_a_retry_after_is_honoured(tmp_path):
    with CaptureServer(tmp_path, overloaded_for(0.1, 429, {"Retry-After": "1"})) as server:
        times: list[float] = []
        handler = server.complete

        async def timed(request, server):
            times.append(time.monotonic())
            return await handler(request, server)

        server.complete = timed
        ids, _pool = capture_with([server.url], tmp_path, backoff=QUICK_BACKOFF)
    assert ids == [[0, 1, 2, 3, 4]]
    assert len(times) == 2  # not asked again before the second it asked for (backoff: 0.1 s)
    assert times[1] - times[0] >= 1.0


async def capture_rows(urls, slots, rows, **pool_args):
    async with CapturePool(urls, MODEL, 1, 5.0, slots, **pool_args) as pool:
        tasks = [
            asyncio.create_task(pool.capture(PROMPT, f"eaglenest-test-{row}", row, read_ids))
            for row in rows
        ]
        try:
            return await asyncio.gather(*tasks), pool
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def slowly_overloaded(request, server):
    await server.take(request)
    await asyncio.sleep(0.5)  # the other server serves meanwhile
    return web.Response(status=503, text="Service Unavailable")


def test_an_overload_counts_as_a_move_when_another_server_served_meanwhile(tmp_path):
    with (
        CaptureServer(tmp_path, slowly_overloaded) as busy,
        CaptureServer(tmp_path) as good,
        pytest.raises(CaptureServerError) as failure,
    ):
        asyncio.run(
            capture_rows([busy.url, good.url], tmp_path, [0, 1], moves_max=1, backoff=QUICK_BACKOFF)
        )
    assert str(failure.value).startswith("sample row 0: sent 1 times to servers that failed it")
    assert f"the last: {busy.url}: HTTP 503" in str(failure.value)
    assert len(good.sent) == 1


def test_an_overload_of_every_server_does_not_count_as_a_move(tmp_path):
    """The same, but every server is overloaded (until one moment, then all serve): waiting,
    not the samples' fault."""
    opens_at = time.monotonic() + 1.0

    async def overloaded_until_then(request, server):
        if time.monotonic() < opens_at:
            await server.take(request)
            return web.Response(status=503, text="Service Unavailable")
        return await complete_whole(request, server)

    with (
        CaptureServer(tmp_path, overloaded_until_then) as first,
        CaptureServer(tmp_path, overloaded_until_then) as second,
    ):
        answers, pool = asyncio.run(
            capture_rows([first.url, second.url], tmp_path, [0, 1, 2, 3], moves_max=1,
                         backoff=QUICK_BACKOFF)
        )  # fmt: skip
    assert answers == [[0, 1, 2, 3, 4]] * 4
    assert len(first.sent) + len(second.sent) > 4 + 4  # sent again and again, never a move
    assert sum(s.moved for s in pool.servers) > 4


def test_many_waiting_requests_are_served_in_order_without_polling(tmp_path):
    """Cap 1, one server whose first answer takes 0.5 s: 200 requests wait behind it. They are
    sent in the order they came, and the pool looked for free slots about once per POLL_S plus
    once per release, not once per waiting request per POLL_S (200 x 50 looks)."""
    waiting, held_s = 200, 0.5

    async def first_slow(request, server):
        if not server.sent:
            await asyncio.sleep(held_s)
        return await complete_whole(request, server)

    started = time.monotonic()
    with CaptureServer(tmp_path, first_slow) as server:
        answers, pool = asyncio.run(capture_rows([server.url], tmp_path, range(waiting + 1)))
    elapsed = time.monotonic() - started
    assert answers == [[0, 1, 2, 3, 4]] * (waiting + 1)
    assert server.sent == [f"eaglenest-test-{row}-1" for row in range(waiting + 1)]
    assert pool.queue is not None
    assert pool.queue.scans <= 2 * elapsed / POLL_S + waiting + 1, pool.queue.scans
    assert not pool.queue.waiters


async def proxy_page(request, server):
    await server.take(request)
    return web.Response(text="<html>proxy error</html>")


def test_the_final_error_after_garbage_names_it(tmp_path):
    """A server answered garbage, then stopped answering: the error said only "no capture server
    answers"; it names what each server last said, the garbage included."""
    probes: list[int] = []

    async def models_then_garbage(request, server):
        probes.append(1)
        if len(probes) == 1:
            return await models_ok(request, server)
        return web.Response(text="<html>a login page</html>")

    with (
        CaptureServer(tmp_path, proxy_page, models_then_garbage) as server,
        pytest.raises(CaptureServerError) as failure,
    ):
        capture_with([server.url], tmp_path, rows=[5], wait_s=0.5)
    message = str(failure.value)
    assert message.startswith("no capture server answers")
    assert f"{server.url}: /v1/models answered what is not a model list" in message
    assert "before that, to a request: sample row 5: answered 200 with what is not JSON" in message
    assert "<html>proxy error</html>" in message
