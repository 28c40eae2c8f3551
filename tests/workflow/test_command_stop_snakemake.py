"""Stopping a command run by `eaglenest serve-capture` (eaglenest.common.command) cannot deadlock
Snakemake, even when the signal lands while Snakemake finishes a job.

Snakemake 9.27.1's SIGTERM handler takes the scheduler's lock, which the main thread holds while
it finishes jobs; a SIGTERM landing then hangs Snakemake for good. The workflow here makes the
landing certain: when its checkpoint finishes, Snakemake re-evaluates an input function in its main
thread under that lock (`_finish_jobs` -> `dag.update_checkpoint_dependencies`), and the function
marks the moment and waits there. The runner is stopped at that moment, as a scheduler or a user
stops serve-capture (SIGTERM); it must stop Snakemake in seconds, with nothing left running and the
workflow's lock released."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SNAKEFILE = """
import os, time
from pathlib import Path


rule all:
    input:
        lambda wildcards: after_first(wildcards),


checkpoint first:
    output:
        "first.txt",
    shell:
        "touch {output}"


def after_first(wildcards):
    checkpoints.first.get()
    # Snakemake's main thread, holding the scheduler's lock: the test stops the runner now.
    Path("finishing").write_text(str(os.getpid()))
    time.sleep(3)
    return "first.txt"
"""

RUNNER = """
import sys
from eaglenest.common.command import run_command
sys.exit(run_command([sys.executable, "-m", "snakemake", "--cores", "1"], stop_wait_s=20))
"""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_sigterm_while_snakemake_finishes_a_job_stops_it(tmp_path):
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER], cwd=tmp_path, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    marker = tmp_path / "finishing"
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert runner.poll() is None, runner.stdout.read()
            assert time.monotonic() < deadline, "the checkpoint never finished"
            time.sleep(0.1)
        time.sleep(0.2)
        snakemake_pid = int(marker.read_text())
        os.kill(runner.pid, signal.SIGTERM)
        stopped = time.monotonic()
        code = runner.wait(timeout=60)
        output = runner.stdout.read()
        # The runner's SIGKILL comes after 20 s: Snakemake must have stopped on the first signal.
        assert time.monotonic() - stopped < 15, f"Snakemake hung (its SIGTERM handler?)\n{output}"
        assert code == 130, output
        assert not alive(snakemake_pid), output
        assert "Terminating processes on user request" in output, output
        locks = tmp_path / ".snakemake" / "locks"
        assert not locks.exists() or not any(locks.iterdir()), output
    finally:
        for pid in (runner.pid, *[int(p) for p in [marker.read_text()] if marker.exists()]):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        runner.wait()
