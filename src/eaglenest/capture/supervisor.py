"""`eaglenest serve-capture`'s watch over its own server process (capture/server.py): started,
ready only when that process is alive and the server lists the run's served name, watched while it
serves, and restarted a bounded number of times when it dies.

"Ready" was any HTTP 200 on the port: another process there made a server that never started look
ready, and a server that died after it was ready left serve-capture "serving" (and its wrapped
Snakemake waiting `vllm.capture_wait_s` on it, blaming the pool). Here:
- before it starts, the port must be free (another process there: said at once, nothing started);
- ready = the child is alive AND `/v1/models` (with the capture key, when there is one) lists the
  served name; an answer of 401/403 fails at once ("authentication"), it never gets better;
- while it serves, the child's exit, or vLLM's `/health` answering 503 (its engine core dead while
  its HTTP front stays up), is a death: the last error lines of the server's log say why;
- a dead server is restarted at the same address, with the same request (served name, storage),
  at most `restarts` times: the capture pool's jobs, which probe a server that stopped answering
  every few seconds, take requests there again once it lists the name.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.client.credentials import redact
from eaglenest.vllm_engine.process import EngineError, die_with_parent, stop_process_group

log = logging.getLogger(__name__)

WATCH_PROBE_TIMEOUT_S = 5  # its own probes of the server it watches: /v1/models and /health
READY_POLL_S = 1.0
HEALTH_DEAD = 503  # vLLM's /health once its engine core is dead (EngineDeadError)
TAIL_LINES = 15
SERVER_STOP_WAIT_S = 30  # after SIGTERM, before SIGKILL: vLLM's server and engine core


class ServerDied(EngineError):
    """The capture server's process exited, or its engine died, and no restart is left."""


def port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound (another process listens there), or None when it can.
    Bound as vLLM binds it (SO_REUSEADDR), then released at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        return f"{host} does not resolve here ({err})"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already taken by another process"
            return f"{host}:{port} cannot be bound here ({err.strerror})"
    return None


def probe(url: str, served_name: str, key: str | None) -> str | None:
    """None when the server at `url` lists `served_name` on /v1/models; why not otherwise (not
    listening yet, another name, an answer that is not a model list). Raises on 401/403: a key
    problem, which waiting does not cure."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"{url}/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=WATCH_PROBE_TIMEOUT_S) as response:
            body = response.read()
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise EngineError(
                f"capture server at {url} answered HTTP {err.code} to its own readiness probe: "
                "authentication failed (the server wants another key than "
                f"{'the one of vllm.capture_key_env' if key else 'none'}: vllm.capture_key_env)"
            ) from None
        return f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return f"not answering ({getattr(err, 'reason', err)})"
    try:
        served = [m.get("id") for m in json.loads(body).get("data") or []]
    except (ValueError, AttributeError):
        # Without the key: another program on the port may echo the request's headers.
        shown = redact(repr(body[:200]), [key])
        return f"/v1/models answered something that is not a model list: {shown}"
    if served_name not in served:
        return f"it serves {served}, not {served_name}"
    return None


def engine_dead(url: str) -> bool:
    """Whether vLLM says its engine is dead (/health 503; /health needs no key). Any other answer,
    or none, is not a death: a busy server may answer late, and a gone one shows in its exit."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=WATCH_PROBE_TIMEOUT_S):
            return False
    except urllib.error.HTTPError as err:
        return err.code == HEALTH_DEAD
    except (urllib.error.URLError, OSError):
        return False


def error_lines(text: str, lines: int = TAIL_LINES) -> str:
    """What a server's log says about its end: the last lines that look like an error (a
    traceback's, ERROR lines), else its last lines."""
    last = text.splitlines()[-200:]
    marks = ("Error", "ERROR", "Traceback", "Exception", "error:", "Killed", "CRITICAL")
    errors = [line for line in last if any(mark in line for mark in marks)]
    return "\n".join((errors or last)[-lines:])


@dataclass
class SupervisedServer:
    """One server process (`argv` with `env`, its output appended to `log_path`), served at `url`
    under `served_name`, restarted at most `restarts` times."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    url: str
    served_name: str
    key: str | None = None
    restarts: int = 2
    startup_timeout_s: float = 1800
    restarted: int = 0
    process: subprocess.Popen | None = field(default=None, repr=False)
    announced: dict[str, Any] = field(default_factory=dict)  # what serve-capture printed
    _log_offset: int = 0

    def start(self) -> float:
        """Start the process and wait until it is ready; seconds to ready. Raises ServerDied
        (with the log's last error lines) when it exits or is not ready in time."""
        started = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log_stream:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log_stream,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # noqa: PLW1509 (one call looked up before the fork)
            )
        self._wait_ready(started + self.startup_timeout_s)
        return time.monotonic() - started

    def _wait_ready(self, deadline: float) -> None:
        assert self.process is not None
        while True:
            if self.process.poll() is not None:
                raise ServerDied(
                    self.why(f"exited ({self.process.returncode}) before it was ready")
                )
            problem = probe(self.url, self.served_name, self.key)
            if problem is None:
                # Ready, and still ours: the name could be another server's on a port we lost.
                if self.process.poll() is None:
                    return
                continue
            if time.monotonic() > deadline:
                self.stop()
                raise ServerDied(
                    self.why(f"was not ready after {self.startup_timeout_s:.0f} s ({problem})")
                )
            time.sleep(READY_POLL_S)

    def death(self) -> str | None:
        """Why the server is dead, or None while it lives."""
        if self.process is None:
            return "never started"
        if self.process.poll() is not None:
            return f"exited ({self.process.returncode})"
        if engine_dead(self.url):
            return "its engine died (/health answers 503)"
        return None

    def why(self, what: str) -> str:
        """The message a user reads: the server, what happened, its log's last error lines."""
        text = ""
        if self.log_path.exists():
            with open(self.log_path, "rb") as stream:
                stream.seek(self._log_offset)
                text = stream.read().decode(errors="replace")
        tail = redact(error_lines(text), [self.key]) or "(its log is empty)"
        return f"capture server at {self.url} {what}; the end of its log ({self.log_path}):\n{tail}"

    def check(self) -> None:
        """Called while serving: nothing while the server lives; a dead one is restarted (and
        waited for) while restarts are left, else ServerDied."""
        death = self.death()
        if death is None:
            return
        message = self.why(death)
        while True:
            self.stop()
            if self.restarted >= self.restarts:
                raise ServerDied(f"{message}\nno restart left (--restarts {self.restarts})")
            self.restarted += 1
            log.error(
                "%s\nrestarting it (%d of --restarts %d)", message, self.restarted, self.restarts
            )
            try:
                ready_s = self.start()
            except ServerDied as err:  # a restart that never got ready: the next, if any
                message = str(err)
                continue
            log.info("capture server at %s ready again after %.1f s", self.url, ready_s)
            return

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process, SERVER_STOP_WAIT_S)


def child_env(base: dict[str, str], key: str | None) -> dict[str, str]:
    """The server's environment: `base` with the capture key as vLLM's VLLM_API_KEY (in the
    environment, never in argv, which vLLM and `ps` print), and without any VLLM_API_KEY of the
    caller's when the config names no key: a key the jobs do not send made serve-capture wait
    its whole start-up timeout on 401s."""
    env = {k: v for k, v in base.items() if k != "VLLM_API_KEY"}
    if key:
        env["VLLM_API_KEY"] = key
    return env
