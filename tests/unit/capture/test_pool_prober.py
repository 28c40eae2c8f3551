"""The capture pool's background prober (capture/pool.py) asks the servers it set aside again:
one that comes back on its port takes the waiting samples; one that answers /v1/models with
garbage stays aside, and the job fails after `capture_wait_s` naming the URLs, its log saying
what came back; and whatever error the prober itself meets fails the pool, instead of a dead
prober leaving the requests to wait forever. Stand-in servers on 127.0.0.1
(tests/support/capture_servers.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from aiohttp import web
from support.capture_servers import CaptureServer, capture_with, models_ok

from eaglenest.capture import pool as capture_pool
from eaglenest.capture.pool import CapturePool, CaptureServerError


@pytest.fixture(autouse=True)
def quick_probes(monkeypatch):
    monkeypatch.setattr(capture_pool, "PROBE_S", 0.05)


def test_a_server_that_leaves_and_comes_back_takes_the_waiting_sample(
    tmp_path, caplog, monkeypatch
):
    caplog.set_level(logging.INFO, logger="eaglenest.capture.pool")
    server = CaptureServer(tmp_path).start()
    real_enter = CapturePool.__aenter__

    async def enter_then_leave(pool):  # the server leaves once the pool has checked it
        entered = await real_enter(pool)
        server.stop()
        threading.Timer(0.5, server.start).start()  # restarted on its port half a second later
        return entered

    monkeypatch.setattr(CapturePool, "__aenter__", enter_then_leave)
    try:
        started = time.monotonic()
        ids, pool = capture_with([server.url], tmp_path, wait_s=10.0)
    finally:
        time.sleep(0.6)  # the restart, even after a failure, before the server is stopped
        server.stop()
    assert ids == [[0, 1, 2, 3, 4]]
    assert (pool.servers[0].answered, pool.servers[0].moved) == (1, 1)
    assert 0.5 <= time.monotonic() - started < 5
    assert f"capture server {server.url} set aside: sample row 0: does not answer" in caplog.text
    assert f"capture server {server.url} answers again" in caplog.text


GARBAGE = {  # made anew for each probe: an aiohttp response is sent once
    "html": lambda: web.Response(text="<html>a login page</html>"),
    "list": lambda: web.json_response([{"id": "x"}]),
    "data-not-a-list": lambda: web.json_response({"data": "eaglenest-capture-test"}),
    "models-not-objects": lambda: web.json_response({"data": ["eaglenest-capture-test"]}),
    "503": lambda: web.json_response({"error": "starting"}, status=503),
}


@pytest.mark.parametrize("garbage", GARBAGE, ids=list(GARBAGE))
def test_a_prober_that_meets_garbage_keeps_the_server_aside_then_fails_in_time(
    tmp_path, caplog, garbage
):
    caplog.set_level(logging.WARNING, logger="eaglenest.capture.pool")

    async def models(_request, _server):
        return GARBAGE[garbage]()

    started = time.monotonic()
    with (
        CaptureServer(tmp_path, models=models) as server,
        pytest.raises(CaptureServerError) as failure,
    ):
        capture_with([server.url], tmp_path, wait_s=0.5)
    assert str(failure.value).startswith(
        f"no capture server answers (vllm.capture_urls: {server.url}) after waiting 0.5 s"
    )
    assert time.monotonic() - started < 5
    said = "/v1/models answered " + ("HTTP 503" if garbage == "503" else "what is not a model list")
    assert f"capture server {server.url} set aside: {said}" in caplog.text
    assert server.sent == []


def test_any_error_the_prober_meets_fails_the_pool(tmp_path, monkeypatch):
    async def dropped(request, server):
        await server.take(request)
        request.transport.close()
        return web.Response()

    calls = []

    async def broken_problem(pool, server):
        calls.append(server.url)
        if len(calls) > 1:  # the prober's, after the pool's own check at the start
            raise RuntimeError("an error nobody foresaw")
        return await real_problem(pool, server)

    real_problem = CapturePool._problem
    monkeypatch.setattr(CapturePool, "_problem", broken_problem)
    started = time.monotonic()
    with (
        CaptureServer(tmp_path, dropped, models_ok) as server,
        pytest.raises(CaptureServerError) as failure,
    ):
        capture_with([server.url], tmp_path, wait_s=30.0)
    assert str(failure.value).startswith(
        "the capture pool's prober failed (RuntimeError: an error nobody foresaw); servers: "
        + server.url
    )
    assert time.monotonic() - started < 5  # not capture_wait_s, not forever


def test_a_probe_that_gets_no_answer_in_time_is_a_server_that_does_not_answer(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(capture_pool, "PROBE_TIMEOUT_S", 0.2)
    caplog.set_level(logging.WARNING, logger="eaglenest.capture.pool")

    async def stuck(_request, _server):
        await asyncio.sleep(1.5)  # past every probe's timeout: an HTTP side that hangs
        return web.json_response({})

    started = time.monotonic()
    with (
        CaptureServer(tmp_path, models=stuck) as server,
        pytest.raises(CaptureServerError, match="no capture server answers"),
    ):
        capture_with([server.url], tmp_path, wait_s=0.5)
    assert time.monotonic() - started < 5
    assert f"capture server {server.url} set aside: does not answer (TimeoutError)" in caplog.text
