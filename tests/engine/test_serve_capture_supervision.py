"""`eaglenest serve-capture` watches its own server (eaglenest.capture.supervisor): the real
command, its real supervision loop, over a stand-in server process instead of vLLM (no engine
starts here: `vllm.python` names a script that serves /v1/models and /health as vLLM's server
does, then misbehaves as told), so each case takes seconds:
- a port another process holds: said at once, nothing started, the wrapped command never runs;
- a server that dies after it was ready: with no restart left, serve-capture stops its wrapped
  command and exits non-zero with the server's last error lines;
- a server that never gets ready (it serves another name): fails after --startup-timeout-s;
- restarts, at most --restarts N, at the same URL, the wrapped command running across them and
  seeing the restarted server; an engine that dies behind a live HTTP front (/health 503) too.
The real vLLM killed mid-run and restarted: tests/engine/test_vllm_capture_server.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from support.capture_servers import CaptureServer
from support.servers import free_port
from support.workflow import DEMO_CONFIGFILE, REPO

# The server's stand-in, run as `<it> -m eaglenest.vllm_engine.serve <request.json>`.
STANDIN = """#!{python}
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

request = json.loads(open(sys.argv[-1]).read())
mode = os.environ["STANDIN_MODE"]
starts = os.path.join(os.path.dirname(sys.argv[-1]), "starts")
with open(starts, "a") as stream:
    stream.write("start\\n")
first = open(starts).read().count("start") == 1
name = "another-name" if mode == "other-name" else request["served_name"]
dead = []

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            self.send_response(503 if dead else 200)
            self.end_headers()
            return
        body = json.dumps({{"data": [{{"id": name}}]}}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

print("INFO standin: loading the target", flush=True)
server = ThreadingHTTPServer((request["host"], request["port"]), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
if mode == "dies" or (mode == "dies-once" and first):
    time.sleep(2)
    print("Traceback (most recent call last):", flush=True)
    print("RuntimeError: The expanded size of the tensor (4) must match (3)", flush=True)
    sys.exit(1)
if mode == "engine-dies-once" and first:
    time.sleep(2)
    print("ERROR standin: EngineCore died unexpectedly", flush=True)
    dead.append(True)
while True:
    time.sleep(1)
"""
# A wrapped command: records that it started, waits, then checks the server answers again.
WRAPPED = """
import json, sys, time, urllib.request
open(sys.argv[1], "a").write("started\\n")
time.sleep(float(sys.argv[3]))
with urllib.request.urlopen(sys.argv[2] + "/v1/models", timeout=5) as response:
    print("WRAPPED sees", json.loads(response.read())["data"][0]["id"], flush=True)
"""


def setup(tmp_path: Path, port: int) -> Path:
    """A target of 8 layers (its config.json only) and an override naming the stand-in."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
        "intermediate_size": 192, "num_hidden_layers": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512,
    }))  # fmt: skip
    standin = tmp_path / "standin"
    standin.write_text(STANDIN.format(python=sys.executable))
    standin.chmod(0o755)
    override = tmp_path / "override.yaml"
    override.write_text(json.dumps({
        "run": "standin", "demo_target": {"enabled": False}, "target": {"path": str(target)},
        "hidden": {"backend": "vllm"},
        "vllm": {"python": str(standin), "capture_url": f"http://127.0.0.1:{port}"},
    }))  # fmt: skip
    return override


def serve_capture(tmp_path: Path, mode: str, *args: str, port: int | None = None):
    """(return code, stdout + stderr, seconds, storage) of serve-capture over the stand-in."""
    port = port or free_port()
    override, storage = setup(tmp_path, port), tmp_path / "storage"
    argv = [sys.executable, "-m", "eaglenest.cli", "serve-capture", "--configfile",
            DEMO_CONFIGFILE, str(override), "--storage-dir", str(storage), *args]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "STANDIN_MODE": mode})  # fmt: skip
    output = done.stdout + done.stderr
    return done.returncode, output, time.monotonic() - started, storage


def wrapped(tmp_path: Path, port: int, wait_s: float) -> list[str]:
    script = tmp_path / "wrapped.py"
    script.write_text(WRAPPED)
    url = f"http://127.0.0.1:{port}"
    return ["--", sys.executable, str(script), str(tmp_path / "wrapped-starts"), url, str(wait_s)]


def test_a_port_another_process_holds_fails_at_once_and_runs_nothing(tmp_path):
    with CaptureServer(tmp_path) as other:  # answers 200 on /v1/models, as the did
        rc, out, _, storage = serve_capture(
            tmp_path, "serves", *wrapped(tmp_path, other.port, 0), port=other.port
        )
    assert rc == 2, out
    assert f"port {other.port} on 127.0.0.1 is already taken by another process" in out
    assert not (tmp_path / "wrapped-starts").exists() and not (storage / "starts").exists()


def test_a_server_that_dies_after_ready_stops_the_run_and_says_why(tmp_path):
    port = free_port()
    rc, out, seconds, _ = serve_capture(
        tmp_path, "dies", "--restarts", "0", *wrapped(tmp_path, port, 60), port=port
    )
    assert rc == 2, out
    assert f"capture server at http://127.0.0.1:{port} exited (1)" in out
    assert "RuntimeError: The expanded size of the tensor (4) must match (3)" in out
    assert "no restart left (--restarts 0)" in out
    assert "EAGLENEST " in out  # it was ready first
    assert (tmp_path / "wrapped-starts").read_text() == "started\n"
    assert seconds < 40, "the wrapped command (60 s) was not stopped"
    assert "WRAPPED sees" not in out


def test_a_server_that_never_gets_ready_fails_after_the_startup_timeout(tmp_path):
    rc, out, _, _ = serve_capture(tmp_path, "other-name", "--startup-timeout-s", "3")
    assert rc == 2, out
    assert "was not ready after 3 s (it serves ['another-name'], not eaglenest-capture-" in out
    assert "INFO standin: loading the target" in out  # the end of its log
    assert "EAGLENEST " not in out


def test_restarts_are_bounded_and_the_wrapped_command_runs_across_them(tmp_path):
    port = free_port()
    rc, out, _, storage = serve_capture(
        tmp_path, "dies", "--restarts", "2", *wrapped(tmp_path, port, 60), port=port
    )
    assert rc == 2, out
    assert out.count("restarting it (") == 2 and "no restart left (--restarts 2)" in out
    assert (storage / "starts").read_text().count("start") == 3
    assert (tmp_path / "wrapped-starts").read_text() == "started\n"  # one command throughout


def test_a_restarted_server_serves_the_waiting_command_at_the_same_url(tmp_path):
    for mode in ("dies-once", "engine-dies-once"):
        case = tmp_path / mode
        case.mkdir()
        port = free_port()
        rc, out, _, storage = serve_capture(case, mode, *wrapped(case, port, 8), port=port)
        assert rc == 0, out
        assert "restarting it (1 of --restarts 2)" in out
        assert f"capture server at http://127.0.0.1:{port} ready again" in out
        assert ("exited (1)" if mode == "dies-once" else "its engine died (/health") in out
        assert "WRAPPED sees eaglenest-capture-" in out
        assert (storage / "starts").read_text().count("start") == 2
