"""Local servers in tests: a free port on 127.0.0.1 and the wait for a server's /health."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    """A port nothing listens on now (the OS's pick; closed again before it is returned)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthy(url: str) -> bool:
    """Whether `url`/health answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(
    process: subprocess.Popen, url: str, log_path: Path, timeout_s: float, name: str = "the server"
) -> None:
    """Until `url` is healthy; fails the test with the end of the server's log when its process
    exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if process.poll() is not None:
            state = f"exited with code {process.returncode}"
        elif time.monotonic() > deadline:
            state = f"not healthy after {timeout_s} s"
        else:
            time.sleep(1)
            continue
        pytest.fail(f"{name} {state} at start; end of its log:\n{log_path.read_text()[-4000:]}")
