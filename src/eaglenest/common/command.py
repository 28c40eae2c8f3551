"""A command run for the length of something of ours (`eaglenest serve-capture -- snakemake ...`),
stopped the way Ctrl-C stops it.

Snakemake 9.27.1 must not be stopped with SIGTERM: its handler (`JobScheduler.exit_gracefully`)
takes the scheduler's lock, a `threading.Lock`, which the main thread holds while it finishes or
fails jobs; a SIGTERM landing then deadlocks it for good (docs/vllm-cpu.md, known issues). SIGINT
has no handler of Snakemake's: it raises KeyboardInterrupt in the main thread (or, while the
scheduler runs a job's postprocessing under asyncio.run, cancels that task at its next await,
which asyncio turns into KeyboardInterrupt), which leaves the `with self._lock` blocks it crosses,
releasing the lock, and reaches the scheduler's `except KeyboardInterrupt`, which cancels the
jobs (tests/workflow/test_command_stop_snakemake.py). So the command runs in its own process group
and is stopped as a terminal's Ctrl-C stops it: SIGINT to the whole group (Snakemake and its local
jobs, which its cancel waits for), then SIGKILL to what is left after `stop_wait_s`.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Sequence

from eaglenest.vllm_engine.process import die_with_parent, stop_process_group

COMMAND_STOP_WAIT_S = 60  # Snakemake's cancel waits for its jobs and cancels cluster jobs


def start_command(argv: Sequence[str]) -> subprocess.Popen:
    """`argv` in its own process group, killed if this process dies (kill -9 included)."""
    return subprocess.Popen(
        list(argv),
        start_new_session=True,
        preexec_fn=die_with_parent(),  # noqa: PLW1509 (one call looked up before the fork)
    )


def run_command(argv: Sequence[str], stop_wait_s: float = COMMAND_STOP_WAIT_S) -> int:
    """Run `argv` to its end; SIGTERM or Ctrl-C to this process stops it as Ctrl-C would (SIGINT
    to its group, SIGKILL after `stop_wait_s`: vllm_engine.process.stop_process_group) and
    returns 130. The caller's SIGTERM handler is restored afterwards."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    process = None
    try:
        process = start_command(argv)
        return process.wait()
    except KeyboardInterrupt:
        if process is not None:
            stop_process_group(process, stop_wait_s, first=signal.SIGINT)
            process.wait()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
