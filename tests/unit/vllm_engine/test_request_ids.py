"""Request ids name the capture server's state files (`<storage>/cmpl-<id>-0.safetensors`, and
vLLM's connector creates the directories they name): ids that could escape the storage are
answered 400 before vLLM sees them (eaglenest.vllm_engine.request_ids, the middleware that
serve.py gives vLLM's server). The ASGI middleware runs here over a stand-in app."""

from __future__ import annotations

import asyncio
import json

import pytest

from eaglenest.vllm_engine.request_ids import SafeRequestIds, unsafe_request_id
from eaglenest.vllm_engine.serve import server_argv


@pytest.mark.parametrize(
    "request_id",
    ["../../etc/cron.d/x", "a/b", "/abs/path", "..", "x..y", "a\\b", "a\x00b", "", 7, "x" * 201],
)
def test_ids_that_could_leave_the_storage_are_refused(request_id):
    assert unsafe_request_id(request_id) is not None


def test_the_pools_ids_and_vllms_own_pass():
    for ok in ("eaglenest-3f2a9c1b0d4e-a1b2c3-17-1", "0b7c1e5e-uuid-like", "job.1:rank0", None):
        assert unsafe_request_id(ok) is None


def call(body: bytes, headers=()) -> tuple[list, list]:
    """(what the app received, what was sent back) for one POST through the middleware."""
    seen, sent = [], []

    async def app(scope, receive, send):
        message = await receive()
        seen.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    chunks = [body[:5], body[5:]]  # a body that comes in two pieces

    async def receive():
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    asyncio.run(SafeRequestIds(app)(scope, receive, send))
    return seen, sent


def test_the_middleware_answers_400_and_vllm_never_sees_the_request():
    seen, sent = call(json.dumps({"prompt": [1, 2], "request_id": "../../x"}).encode())
    assert seen == [] and sent[0]["status"] == 400
    message = json.loads(sent[1]["body"])["error"]["message"]
    assert "request id '../../x'" in message and "storage" in message
    seen, sent = call(b'{"prompt": [1]}', headers=[(b"x-request-id", b"a/../../b")])
    assert seen == [] and sent[0]["status"] == 400
    good = json.dumps({"prompt": [1, 2], "request_id": "eaglenest-k-a-1-1"}).encode()
    seen, sent = call(good)
    assert b"".join(seen) == good[:5] and sent[0]["status"] == 200  # handed on as it came


def test_the_server_is_started_with_the_middleware_and_without_the_key():
    request = {
        "target": "/t", "dtype": "float32", "quantization": None, "engine_args": {},
        "cpu_workarounds": False, "max_model_len": 64, "tensor_parallel_size": 1,
        "gpu_memory_utilization": None, "requests_per_batch": 4, "trust_remote_code": False,
        "layer_ids": [1, 2, 3, 4], "out_dir": "/tmp/s", "host": "127.0.0.1", "port": 1,
        "served_name": "eaglenest-capture-x",
    }  # fmt: skip
    argv = server_argv(request)
    assert (
        argv[argv.index("--middleware") + 1] == "eaglenest.vllm_engine.request_ids.SafeRequestIds"
    )
    assert "--api-key" not in argv
