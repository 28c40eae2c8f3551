"""An engine process dies with the job that started it, whatever signal ends the job (SIGTERM runs
`finally`, which removes the temp file; after SIGKILL the next write does), and an engine's
message to its job is one write, found after a worker's partial line. Real processes, real
signals."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.workflow import REPO

from eaglenest.common.io import write_json

SRC = REPO / "src"


JOB = """
import sys, time
from pathlib import Path
from eaglenest.vllm_engine.process import engine_process
from eaglenest.common.io import atomic_path
from eaglenest.common.logs import log_to

out = Path(sys.argv[1])
with log_to(out.with_suffix(".log")):
    with atomic_path(out) as tmp, engine_process(
        sys.executable, "timeit", ["-n", "1", "-r", "1", "import time; time.sleep(120)"], {}
    ) as engine:
        tmp.write_text("half")
        print(engine.pid, flush=True)
        time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def start_job(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, str(tmp_path / "out.json")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    engine_pid = int(job.stdout.readline())
    assert alive(engine_pid)
    return job, engine_pid


def wait_dead(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_signal_leaves_an_engine_or_a_temp_file_behind(tmp_path, sig):
    job, engine_pid = start_job(tmp_path)
    try:
        job.send_signal(sig)
        job.wait(60)
        assert wait_dead(engine_pid, 10), f"the engine outlived its job ({sig.name})"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine_pid, signal.SIGKILL)
        job.kill()
    temps = list(tmp_path.glob(".out.json.*.tmp"))
    if sig == signal.SIGTERM:  # handled like SIGINT: `finally` removed the temp file
        assert temps == [] and "KeyboardInterrupt" in (tmp_path / "out.log").read_text()
    else:  # nothing runs after SIGKILL: the next write of the output removes it
        assert len(temps) == 1
        write_json(tmp_path / "out.json", {"ok": True})
        assert list(tmp_path.glob(".out.json.*.tmp")) == []


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_an_engine_message_is_one_write_and_is_found_after_a_workers_partial_line():
    from eaglenest.vllm_engine.process import MARKER, engine_messages, say

    stream = CountingStream()
    with contextlib.redirect_stdout(stream):
        say({"index": 3, "path": "/x"})
    assert stream.writes == 1 and stream.getvalue() == MARKER + '{"index": 3, "path": "/x"}\n'

    child = textwrap.dedent(
        """
        import sys
        from eaglenest.vllm_engine.process import say
        sys.stdout.write("INFO worker: half a line ")  # a worker's line, cut by our message
        sys.stdout.flush()
        say({"done": True})
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", child],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    messages = list(engine_messages(process, []))
    process.wait()
    assert messages == [{"done": True}]
