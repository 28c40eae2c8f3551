"""Every failure of a capture server's moves the sample to another server (capture/faults.py):
a 5xx, a 200 that is not JSON or not a completion, a dropped connection, a server that answered
and then hung holding its state file's lock, and state files of the wrong layer count, width,
dtype or with non-finite values. The failing server is set aside (the log says why, naming it and
the sample), the healthy one answers, and a sample failed by every server fails the job after
MOVES_MAX sends, naming server, sample and the failure. Stand-in servers on 127.0.0.1
(tests/support/capture_servers.py)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from aiohttp import web
from support.capture_servers import CaptureServer, capture_with, write_states

from eaglenest.capture import pool as capture_pool
from eaglenest.capture import state_file
from eaglenest.capture.pool import MOVES_MAX, CaptureServerError


async def error_500(request, server):
    await server.take(request)
    return web.Response(status=500, text="Internal Server Error: the engine died")


async def not_json(request, server):
    await server.take(request)
    return web.Response(text="<html>proxy error</html>")


async def no_path(request, server):
    await server.take(request)
    return web.json_response({"choices": [{"text": "x"}]})


async def malformed(request, server):
    await server.take(request)
    return web.json_response({"choices": 5, "kv_transfer_params": "a path"})


async def dropped(request, server):
    await server.take(request)
    assert request.transport is not None
    request.transport.close()  # the connection dropped mid-answer (a server killed)
    return web.Response(text="never sent")


async def hung(request, server):
    """Answers, then holds the state file's lock: a writer stuck (a collective, SIGSTOP)."""
    body, path = await server.take(request)
    server.hold_lock(path)
    return server.answer(body, path)


def states(**shape):
    async def complete(request, server):
        body, path = await server.take(request)
        write_states(path, body["prompt"], **shape)
        return server.answer(body, path)

    return complete


FAILURES = {
    "5xx": (error_500, "HTTP 500: Internal Server Error: the engine died"),
    "not-json": (not_json, "answered 200 with what is not JSON"),
    "no-path": (no_path, "without kv_transfer_params.hidden_states_path"),
    "malformed": (malformed, "answered a malformed completion (TypeError"),
    "dropped": (dropped, "does not answer (ServerDisconnectedError"),
    "hung": (hung, "still held the state file's lock 0.3 s after it answered (hung)"),
    "layers": (states(layers=3), "hidden_states of shape (5, 3, 2), expected (5, 4, 2)"),
    "width": (states(hidden=3), "hidden_states of shape (5, 4, 3), expected (5, 4, 2)"),
    "dtype": (
        states(dtype=torch.float16),
        "hidden_states in torch.float16, expected torch.float32",
    ),
    "nan": (states(fill=float("nan")), "hidden_states not finite (first at token 0)"),
}


@pytest.mark.parametrize("failure", FAILURES, ids=list(FAILURES))
def test_a_server_that_fails_a_sample_is_set_aside_and_another_answers(
    tmp_path, monkeypatch, caplog, failure
):
    monkeypatch.setattr(state_file, "LOCK_WAIT_S", 0.3)
    handler, why = FAILURES[failure]
    caplog.set_level(logging.WARNING, logger="eaglenest.capture.pool")
    started = time.monotonic()
    with CaptureServer(tmp_path, handler) as bad, CaptureServer(tmp_path) as good:
        ids, pool = capture_with([bad.url, good.url], tmp_path, rows=[0, 1, 2])
    assert ids == [[0, 1, 2, 3, 4]] * 3
    assert [(s.answered, s.moved) for s in pool.servers] == [(0, 1), (3, 0)], pool.summary()
    assert len(bad.sent) == 1  # set aside: the healthy server took every sample after
    message = caplog.text
    assert f"capture server {bad.url} set aside: sample row 0: " in message
    assert why in message
    assert time.monotonic() - started < 5
    # What the answers named is gone, the hung writer's aside (the job's end sweeps it).
    assert not list(tmp_path.glob("cmpl-*.safetensors")) or failure == "hung"


def test_a_sample_every_server_fails_fails_the_job_after_a_bounded_number_of_sends(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(capture_pool, "PROBE_S", 0.02)  # a set-aside server back at once
    with (
        CaptureServer(tmp_path, error_500) as first,
        CaptureServer(tmp_path, not_json) as second,
        pytest.raises(CaptureServerError) as failure,
    ):
        capture_with([first.url, second.url], tmp_path, rows=[7])
    message = str(failure.value)
    assert message.startswith(f"sample row 7: sent {MOVES_MAX} times to servers that failed it")
    assert first.url in message or second.url in message
    assert "HTTP 500" in message or "not JSON" in message
    assert len(first.sent) + len(second.sent) == MOVES_MAX
    assert min(len(first.sent), len(second.sent)) >= 1  # both tried, none took every send
