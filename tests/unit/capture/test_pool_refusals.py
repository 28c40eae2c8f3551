"""What fails a capture job at once, naming what to fix, instead of moving the sample: a server
that refuses the key (401/403: "authentication", never "another target"), a 4xx that any server
would answer (naming server, sample and status), a server started for another target, and an
answer that names a state file that is not its request's (never read, never deleted). With
`vllm.capture_key_env`, the key goes with every probe and request, and never into a message;
a named variable unset, empty or blank fails before anything is sent, naming the variable. Stand-in
servers on 127.0.0.1 (tests/support/capture_servers.py)."""

from __future__ import annotations

import pytest
from aiohttp import web
from support.capture_servers import CaptureServer, capture_with, complete_whole, models_ok

from eaglenest.capture.pool import CaptureServerError

KEY = "s3cret-capture-key"


def keyed(handler):
    """`handler` behind vLLM's --api-key check: 401 without `Bearer KEY`."""

    async def checked(request, server):
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": f"Unauthorized (got {request.headers})"}, status=401)
        return await handler(request, server)

    return checked


def test_the_key_goes_with_every_probe_and_request(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTURE_KEY", KEY)
    with CaptureServer(tmp_path, keyed(complete_whole), keyed(models_ok)) as server:
        ids, _pool = capture_with([server.url], tmp_path, rows=[0, 1], key_env="CAPTURE_KEY")
    assert ids == [[0, 1, 2, 3, 4]] * 2
    assert server.headers == [f"Bearer {KEY}"] * 3  # the probe, then both requests


@pytest.mark.parametrize("where", ["probe", "request"])
@pytest.mark.parametrize("key", [None, "a-wrong-key"])
def test_a_refused_key_is_an_authentication_error_naming_the_server(
    tmp_path, monkeypatch, where, key
):
    if key:
        monkeypatch.setenv("CAPTURE_KEY", key)
    models = keyed(models_ok) if where == "probe" else models_ok
    with (
        CaptureServer(tmp_path, keyed(complete_whole), models) as server,
        pytest.raises(CaptureServerError) as failure,
    ):
        capture_with([server.url], tmp_path, key_env="CAPTURE_KEY" if key else None)
    message = str(failure.value)
    assert message.startswith(f"capture server {server.url}: authentication failed (HTTP 401)")
    if key:
        assert "refused the key of vllm.capture_key_env (CAPTURE_KEY)" in message
        assert key not in message
    else:
        assert "set vllm.capture_key_env" in message
    assert "another target" not in message
    assert len(server.headers) == (1 if where == "probe" else 2)  # nothing sent again


@pytest.mark.parametrize(
    ("value", "state"),
    [(None, "not set"), ("", "empty"), ("  ", "blank")],
    ids=["unset", "empty", "blank"],
)
def test_a_capture_key_env_without_a_key_fails_before_anything_is_sent(
    tmp_path, monkeypatch, value, state
):
    monkeypatch.delenv("CAPTURE_KEY", raising=False)
    if value is not None:
        monkeypatch.setenv("CAPTURE_KEY", value)
    with CaptureServer(tmp_path) as server, pytest.raises(CaptureServerError) as failure:
        capture_with([server.url], tmp_path, key_env="CAPTURE_KEY")
    assert str(failure.value).startswith(
        f"vllm.capture_key_env names the environment variable CAPTURE_KEY, which is {state}"
    )
    assert server.headers == []


async def bad_request(request, server):
    await server.take(request)
    return web.json_response({"error": "This model's maximum context length is 4"}, status=400)


def test_a_4xx_fails_the_job_at_once_naming_server_sample_and_status(tmp_path):
    with (
        CaptureServer(tmp_path, bad_request) as first,
        CaptureServer(tmp_path) as second,
        pytest.raises(CaptureServerError) as failure,
    ):
        capture_with([first.url, second.url], tmp_path, rows=[4])
    assert str(failure.value).startswith(
        f"sample row 4: capture server {first.url} answered HTTP 400"
    )
    assert "maximum context length" in str(failure.value)
    assert (len(first.sent), len(second.sent)) == (1, 0)  # not sent again anywhere


async def other_target(_request, _server):
    return web.json_response({"data": [{"id": "eaglenest-capture-0123456789abcdef"}]})


def test_a_server_started_for_another_target_is_refused_by_name(tmp_path):
    with (
        CaptureServer(tmp_path, models=other_target) as server,
        pytest.raises(CaptureServerError) as failure,
    ):
        capture_with([server.url], tmp_path)
    assert str(failure.value).startswith(
        f"vllm.capture_urls: {server.url} serves ['eaglenest-capture-0123456789abcdef'], not "
        "eaglenest-capture-test: it was started for another target"
    )


def naming(path_of):
    async def complete(request, server):
        body, _path = await server.take(request)
        return server.answer(body, path_of(server, body))

    return complete


OUTSIDE = {
    "a-file-of-the-user": lambda server, body: server.storage.parent / "victim" / "notes.txt",
    "escaping-with-dots": lambda server, body: (
        f"{server.storage}/../victim/cmpl-{body['request_id']}-0-1.safetensors"
    ),
    "relative": lambda server, body: f"cmpl-{body['request_id']}-0-1.safetensors",
    "another-request": lambda server, body: server.storage / "cmpl-eaglenest-other-0-1.safetensors",
}


@pytest.mark.parametrize("outside", OUTSIDE, ids=list(OUTSIDE))
def test_an_answer_naming_a_file_not_of_its_request_is_refused_and_nothing_deleted(
    tmp_path, outside
):
    storage, victim = tmp_path / "storage", tmp_path / "victim"
    storage.mkdir(), victim.mkdir()
    kept = [victim / "notes.txt", storage / "cmpl-eaglenest-other-0-1.safetensors"]
    for path in kept:
        path.write_text("keep me")
        path.with_name(path.name + ".lock").write_text("keep me")
    with (
        CaptureServer(storage, naming(OUTSIDE[outside])) as server,
        pytest.raises(CaptureServerError) as failure,
    ):
        capture_with([server.url], tmp_path / "slots", rows=[2])
    message = str(failure.value)
    assert message.startswith(f"sample row 2: capture server {server.url} named ")
    assert "as the state file of request eaglenest-test-2-1: not a file of that request" in message
    assert "refused, nothing read or deleted" in message
    assert all(path.read_text() == "keep me" for path in kept)
    assert all(path.with_name(path.name + ".lock").exists() for path in kept)


async def echo_400(request, server):
    """A proxy that quotes the request it refused, its key included."""
    await server.take(request)
    return web.Response(status=400, text=f"bad request: {dict(request.headers)}")


def test_a_server_text_quoted_in_an_error_never_shows_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTURE_KEY", KEY)
    with CaptureServer(tmp_path, echo_400) as server, pytest.raises(CaptureServerError) as failure:
        capture_with([server.url], tmp_path, key_env="CAPTURE_KEY")
    assert "'Authorization': 'Bearer <redacted>'" in str(failure.value)
    assert KEY not in str(failure.value)
