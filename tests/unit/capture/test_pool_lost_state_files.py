"""A capture server that answers and then ends before its state file is whole has dropped the
sample: the pool sends it to another server, and the job goes on (the race the two-server kill
test can only hit by chance). Stand-in servers (tests/support/capture_servers.py) answer as vLLM's
capture servers do: the name on /v1/models, and a completion whose kv_transfer_params names a
state file with a `.lock` beside it that the writer no longer holds."""

from __future__ import annotations

import json

import pytest
from support.capture_servers import CaptureServer, capture_with, write_states

from eaglenest.capture import pool as capture_pool
from eaglenest.capture.pool import MOVES_MAX, CaptureServerError


async def torn(request, server):
    body, path = await server.take(request)
    write_states(path, body["prompt"])
    path.write_bytes(path.read_bytes()[:-7])  # the writer killed in the middle of the write
    return server.answer(body, path)


async def missing(request, server):
    """The writer killed between its answer and its write: the lock is left, free, no file."""
    body, path = await server.take(request)
    return server.answer(body, path)


@pytest.mark.parametrize("lost", [missing, torn], ids=["missing", "torn"])
def test_a_state_file_lost_after_the_answer_sends_the_sample_to_another_server(tmp_path, lost):
    with CaptureServer(tmp_path, lost) as first, CaptureServer(tmp_path) as second:
        ids, pool = capture_with([first.url, second.url], tmp_path)
    assert ids == [[0, 1, 2, 3, 4]]
    counts = [(s.answered, s.moved) for s in pool.servers]
    assert counts == [(0, 1), (1, 0)], pool.summary()  # asked first (least loaded, listed first)
    assert [len(first.sent), len(second.sent)] == [1, 1]
    assert sorted(p.name for p in tmp_path.glob("cmpl-*")) == []  # files and locks removed


def test_a_sample_lost_by_every_server_fails_the_job_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(capture_pool, "PROBE_S", 0.05)  # the lone server set aside comes back
    with (
        CaptureServer(tmp_path, missing) as only,
        pytest.raises(CaptureServerError, match="sample row 3: sent 10 times") as failure,
    ):
        capture_with([only.url], tmp_path, rows=[3], wait_s=30.0)
    assert "state file is missing or torn" in str(failure.value)
    assert only.url in str(failure.value)
    assert len(only.sent) == MOVES_MAX == 10
    assert json.dumps(sorted(p.name for p in tmp_path.glob("cmpl-*"))) == "[]"
