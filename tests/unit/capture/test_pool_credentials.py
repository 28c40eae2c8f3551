"""Credentials in a capture URL (`http://user:pw@host/?key=...`, which the config accepts) reach
no log and no error of the capture pool, even when a gateway echoes the request it was sent (its
URL with the query, its `Authorization: Basic` header made of the user info) in a 502 answer or
its probe's. Stand-in servers on 127.0.0.1 (tests/support/capture_servers.py)."""

from __future__ import annotations

import base64
import logging

import pytest
from aiohttp import web
from support.capture_servers import CaptureServer, capture_with

from eaglenest.capture import pool as capture_pool
from eaglenest.capture.pool import CaptureServerError
from eaglenest.client.retry import RetryPolicy

USER, PASSWORD, QUERY_KEY = "capture-user", "pw-s3cret-capture", "qk-s3cret-capture"
BASIC = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


@pytest.fixture(autouse=True)
def quick_probes(monkeypatch):
    monkeypatch.setattr(capture_pool, "PROBE_S", 0.05)


async def echoing_gateway(request, _server):
    """What an ingress in front of a busy server answers: 502, with the request it was sent."""
    echoed = f"{request.method} {request.url} headers: {dict(request.headers)}"
    return web.Response(status=502, text=f"Bad Gateway; upstream busy. Request was: {echoed}")


async def echoing_models(request, _server):
    return web.Response(status=500, text=f"no upstream for {request.url} {dict(request.headers)}")


@pytest.mark.parametrize("models", ["answers", "echoes"])
def test_a_gateway_echoing_the_request_shows_no_credential_in_logs_or_errors(
    tmp_path, caplog, models
):
    from support.capture_servers import models_ok

    quick = RetryPolicy(max_attempts=0, backoff_base_s=0.02, backoff_max_s=0.1)
    probe = models_ok if models == "answers" else echoing_models
    with (
        CaptureServer(tmp_path, echoing_gateway, probe) as server,
        caplog.at_level(logging.INFO),
        pytest.raises(CaptureServerError) as failure,
    ):
        url = server.url.replace("http://", f"http://{USER}:{PASSWORD}@") + f"/?key={QUERY_KEY}"
        capture_with([url], tmp_path, rows=[2], wait_s=0.5, backoff=quick)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("eaglenest")]
    said = "\n".join([str(failure.value), *ours])  # not the stand-in's own access log
    assert "no capture server answers" in str(failure.value)
    assert server.headers and all(h == f"Basic {BASIC}" for h in server.headers)  # it was sent
    for secret in (PASSWORD, QUERY_KEY, BASIC):
        assert secret not in said, secret
    assert "<redacted>" in said
