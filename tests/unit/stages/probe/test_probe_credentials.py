"""The probe and credentials: a key variable of only blanks is named as such (it read as "endpoint
unreachable": the client refuses the header `Bearer ` and blanks); a 401 after an empty variable
says the variable is empty; and a gateway that echoes the request it was sent (its URL's query
key, the Basic-auth header made of its user info) in a 502 puts no credential into the probe's log
or error. A stand-in gateway on 127.0.0.1 (stdlib http.server in a thread)."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eaglenest.client.endpoints import Endpoint
from eaglenest.stages import probe as probe_stage
from eaglenest.stages.probe import ProbeError, probe_endpoint

MODEL = "echo-model"
USER, PASSWORD, QUERY_KEY = "probe-user", "pw-s3cret-probe", "qk-s3cret-probe"
BASIC = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


class Gateway(BaseHTTPRequestHandler):
    """Lists MODEL; answers chat with 502 and the request it got. With `needs_key`, 401 to a
    request without an Authorization header."""

    needs_key = False

    def _send(self, status: int, text: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.needs_key and "Authorization" not in self.headers:
            self._send(401, '{"error": "Unauthorized"}')
            return
        self._send(200, json.dumps({"data": [{"id": MODEL}]}))

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        echoed = f"Authorization: {self.headers.get('Authorization')} POST {self.path}"
        self._send(502, f"Bad Gateway: upstream busy. Your request: {echoed}")

    def log_message(self, *_args) -> None:
        pass


@contextlib.contextmanager
def gateway(needs_key: bool = False) -> Iterator[str]:
    handler = type("ThisGateway", (Gateway,), {"needs_key": needs_key})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(probe_stage, "PROBE_RETRY", probe_stage.RetryPolicy(3, 0.01, 0.01))


def test_a_blank_key_variable_is_named_as_such_not_unreachable(monkeypatch):
    monkeypatch.setenv("EAGLENEST_TEST_KEY", "   ")
    with gateway() as url, pytest.raises(ProbeError) as failure:
        probe_endpoint(Endpoint(url=url, api_key_env="EAGLENEST_TEST_KEY"), MODEL)
    message = str(failure.value)
    assert "EAGLENEST_TEST_KEY, which holds only blanks" in message
    assert "unreachable" not in message


def test_a_401_after_an_empty_key_variable_says_the_variable_is_empty(monkeypatch):
    monkeypatch.setenv("EAGLENEST_TEST_KEY", "")
    with gateway(needs_key=True) as url, pytest.raises(ProbeError) as failure:
        probe_endpoint(Endpoint(url=url, api_key_env="EAGLENEST_TEST_KEY"), MODEL)
    message = str(failure.value)
    assert "refused the request with HTTP 401" in message
    assert "EAGLENEST_TEST_KEY, which is empty" in message


def test_a_gateway_echoing_the_request_puts_no_credential_in_the_probes_log_or_error(caplog):
    with (
        gateway() as url,
        caplog.at_level(logging.WARNING, logger="eaglenest"),
        pytest.raises(ProbeError) as failure,
    ):
        secret_url = url.replace("http://", f"http://{USER}:{PASSWORD}@") + f"/v1?key={QUERY_KEY}"
        probe_endpoint(Endpoint(url=secret_url), MODEL)
    said = str(failure.value) + "\n" + caplog.text
    assert "failed 3 times; last: HTTP 502" in str(failure.value)
    assert "Authorization: Basic <redacted>" in said  # what the gateway echoed, redacted
    for secret in (PASSWORD, QUERY_KEY, BASIC):
        assert secret not in said, secret
