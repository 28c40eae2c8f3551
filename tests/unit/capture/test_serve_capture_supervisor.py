"""What `eaglenest serve-capture` checks before and while its server runs, without starting one
(capture/supervisor.py, capture/server.py): a port another process holds, a readiness probe that
wants the run's served name (and the key), the key read from the variable the config names, no
bind beyond loopback without a key, and the log lines that say why a server died. The watch over
a real child process (a stand-in server, and vLLM) is in tests/engine/test_serve_capture_*.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web
from support.capture_servers import MODEL, CaptureServer
from support.servers import free_port

from eaglenest.capture.key import CaptureKeyError, capture_key
from eaglenest.capture.server import capture_server, checked_key, is_loopback, merged_config
from eaglenest.capture.supervisor import child_env, error_lines, port_taken, probe
from eaglenest.common.config import REPO_ROOT
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.vllm_engine.process import EngineError


async def unauthorized(_request, _server):
    return web.json_response({"error": "Unauthorized"}, status=401)


async def garbage(_request, _server):
    return web.Response(text="<html>a proxy's page</html>")


def test_a_port_another_process_holds_is_said_before_anything_starts(tmp_path):
    with CaptureServer(tmp_path) as other:
        assert port_taken("127.0.0.1", other.port) == (
            f"port {other.port} on 127.0.0.1 is already taken by another process"
        )
        config = merged_config([str(REPO_ROOT / "config" / "config.yaml")])
        config["vllm"]["capture_url"] = other.url
        refused = pytest.raises(EngineError, match="already taken by another process; nothing")
        with refused, capture_server(config, storage_dir=str(tmp_path / "storage")):
            pass
    assert not (tmp_path / "storage" / "server-request.json").exists()
    assert port_taken("127.0.0.1", free_port()) is None


def test_ready_means_the_runs_served_name_not_any_answer(tmp_path):
    with CaptureServer(tmp_path) as server:
        assert probe(server.url, MODEL, None) is None
        assert probe(server.url, "eaglenest-capture-other", None) == (
            f"it serves ['{MODEL}'], not eaglenest-capture-other"
        )
        assert probe(server.url, MODEL, "s3cret") is None
        assert server.headers == [None, None, "Bearer s3cret"]  # the key goes with the probe
    with CaptureServer(tmp_path, models=garbage) as server:
        assert "not a model list" in probe(server.url, MODEL, None)
    assert probe(f"http://127.0.0.1:{free_port()}", MODEL, None).startswith("not answering")


async def echoes_the_headers(request, _server):
    return web.Response(text=f"<html>you sent {dict(request.headers)}</html>")


def test_a_readiness_answer_echoing_the_key_is_said_without_it(tmp_path):
    """Another program on the port echoed serve-capture's request: what the probe says (and
    serve-capture logs while it waits) quoted the key of vllm.capture_key_env."""
    key = "s3cret-serve-capture-key"
    with CaptureServer(tmp_path, models=echoes_the_headers) as server:
        said = probe(server.url, MODEL, key)
    assert "not a model list" in said and "<redacted>" in said
    assert key not in said


def test_an_authentication_failure_fails_the_start_at_once(tmp_path):
    """VLLM_API_KEY in the environment made vLLM want a key the probe did not send: serve-capture
    waited its whole start-up timeout (30 minutes) on 401s."""
    with (
        CaptureServer(tmp_path, models=unauthorized) as server,
        pytest.raises(EngineError, match="HTTP 401 .* authentication failed") as err,
    ):
        probe(server.url, MODEL, None)
    assert "vllm.capture_key_env" in str(err.value)


def test_the_key_comes_from_the_variable_the_config_names_and_only_goes_to_vllm(monkeypatch):
    monkeypatch.delenv("EAGLENEST_TEST_KEY", raising=False)
    with pytest.raises(CaptureKeyError, match="variable EAGLENEST_TEST_KEY, which is not set"):
        capture_key("EAGLENEST_TEST_KEY")
    monkeypatch.setenv("EAGLENEST_TEST_KEY", " ")
    with pytest.raises(CaptureKeyError, match="variable EAGLENEST_TEST_KEY, which is blank"):
        capture_key("EAGLENEST_TEST_KEY")
    monkeypatch.setenv("EAGLENEST_TEST_KEY", "s3cret")
    assert capture_key("EAGLENEST_TEST_KEY") == "s3cret"
    assert capture_key(None) is None
    base = {"PATH": "/bin", "VLLM_API_KEY": "the user's, for another server"}
    assert child_env(base, "s3cret") == {"PATH": "/bin", "VLLM_API_KEY": "s3cret"}
    assert child_env(base, None) == {"PATH": "/bin"}  # no key the jobs would not send


def test_no_bind_beyond_loopback_without_a_key(monkeypatch):
    runtime = VllmRuntime.from_config(merged_config([str(REPO_ROOT / "config" / "config.yaml")]))
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "::1", "localhost")] == [True] * 4
    assert [is_loopback(h) for h in ("0.0.0.0", "10.0.0.5", "gpu-01", "::")] == [False] * 4
    assert checked_key(runtime, "127.0.0.1") is None
    with pytest.raises(
        EngineError, match="host 0.0.0.0 is reachable beyond .*vllm.capture_key_env"
    ):
        checked_key(runtime, "0.0.0.0")
    monkeypatch.setenv("EAGLENEST_TEST_KEY", "s3cret")
    keyed = VllmRuntime(**{**runtime.__dict__, "capture_key_env": "EAGLENEST_TEST_KEY"})
    assert checked_key(keyed, "0.0.0.0") == "s3cret"


@pytest.mark.parametrize(
    ("value", "state"),
    [(None, "not set"), ("", "empty"), (" \t", "blank")],
    ids=["unset", "empty", "blank"],
)
def test_serve_capture_refuses_a_key_variable_without_a_key_as_the_pool_does(
    monkeypatch, value, state
):
    """The one reader (capture/key.py) in serve-capture: a named variable unset, empty or blank
    is refused naming it, on loopback too (the pool's jobs refuse it the same way:
    tests/unit/capture/test_pool_refusals.py)."""
    runtime = VllmRuntime.from_config(merged_config([str(REPO_ROOT / "config" / "config.yaml")]))
    keyed = VllmRuntime(**{**runtime.__dict__, "capture_key_env": "EAGLENEST_TEST_KEY"})
    monkeypatch.delenv("EAGLENEST_TEST_KEY", raising=False)
    if value is not None:
        monkeypatch.setenv("EAGLENEST_TEST_KEY", value)
    with pytest.raises(CaptureKeyError) as refused:
        checked_key(keyed, "127.0.0.1")
    assert str(refused.value).startswith(
        f"vllm.capture_key_env names the environment variable EAGLENEST_TEST_KEY, which is {state} "
        "in serve-capture's environment"
    )
    monkeypatch.setenv("EAGLENEST_TEST_KEY", " s3cret ")
    assert checked_key(keyed, "127.0.0.1") == " s3cret "  # a key is used exactly as set


def test_serve_capture_exits_2_naming_a_blank_key_variable(tmp_path, monkeypatch, caplog):
    """The command itself: the refused key is logged and serve-capture exits 2, nothing
    started (as for its other errors)."""
    import argparse
    import signal

    from eaglenest.capture.server import add_arguments, run

    keyed = tmp_path / "keyed.yaml"
    keyed.write_text("vllm:\n  capture_key_env: EAGLENEST_TEST_KEY\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    demo = str(REPO_ROOT / "config" / "config.yaml")
    args = parser.parse_args(["--configfile", demo, str(keyed), "--storage-dir", str(tmp_path)])
    monkeypatch.setenv("EAGLENEST_TEST_KEY", "   ")
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert run(args) == 2
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert "capture_key_env names the environment variable EAGLENEST_TEST_KEY" in caplog.text
    assert "which is blank in serve-capture's environment" in caplog.text
    assert not (tmp_path / "server-request.json").exists()


def test_a_dead_servers_log_says_why_by_its_error_lines():
    log = "\n".join(
        [f"INFO loading shard {i}" for i in range(50)]
        + ["Traceback (most recent call last):", '  File "x.py", line 3']
        + ["RuntimeError: The expanded size of the tensor (4) must match (3)"]
        + ["INFO shutting down"]
    )
    lines = error_lines(log).splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1].startswith("RuntimeError: The expanded size")
    assert error_lines("INFO a\nINFO b") == "INFO a\nINFO b"  # no error line: its last lines


def test_a_death_message_names_a_log_that_still_exists(tmp_path, monkeypatch):
    """The message named server.log inside the temporary storage serve-capture had just removed:
    the default log now lies beside that storage, and stays when the server died."""
    import sys
    import tempfile

    from eaglenest.capture import server as capture_server_module
    from eaglenest.capture.supervisor import ServerDied

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the temporary storage's parent
    monkeypatch.setattr(capture_server_module, "engine_python", lambda _python: sys.executable)
    monkeypatch.setattr(capture_server_module, "SERVE_MODULE", "eaglenest_no_such_server")
    monkeypatch.setattr(
        capture_server_module, "server_request", lambda *_args: {"served_name": MODEL}
    )
    config = merged_config([str(REPO_ROOT / "config" / "config.yaml")])
    config["vllm"]["capture_url"] = f"http://127.0.0.1:{free_port()}"
    with (
        pytest.raises(ServerDied) as died,
        capture_server(config, startup_timeout_s=30, restarts=0),
    ):
        pass
    message = str(died.value)
    assert "exited (1) before it was ready; the end of its log (" in message
    named = message.split("the end of its log (", 1)[1].split("):", 1)[0]
    assert Path(named).is_file(), message
    assert "No module named eaglenest_no_such_server" in Path(named).read_text()
    assert "No module named eaglenest_no_such_server" in message
    assert [p.name for p in tmp_path.iterdir()] == [Path(named).name]  # the storage is gone


def test_a_server_that_never_died_leaves_no_log_behind(tmp_path, monkeypatch):
    import tempfile

    from eaglenest.capture import server as capture_server_module

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(capture_server_module.SupervisedServer, "start", lambda _self: 0.0)
    monkeypatch.setattr(
        capture_server_module, "server_request", lambda *_args: {"served_name": MODEL}
    )
    config = merged_config([str(REPO_ROOT / "config" / "config.yaml")])
    config["vllm"]["capture_url"] = f"http://127.0.0.1:{free_port()}"
    with capture_server(config) as server:
        assert server.log_path.parent == tmp_path
    assert list(tmp_path.iterdir()) == []
