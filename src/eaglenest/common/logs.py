"""Per-job logging: everything a stage prints (logging, progress bars, tracebacks) goes to its log."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM (a SLURM time limit, preemption, Snakemake stopping a job) raises
    KeyboardInterrupt as SIGINT does, so `finally` blocks run: engine processes are stopped,
    temporary files removed. Python's default for SIGTERM ends the process without them."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be set from the main thread
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def log_to(path: str | Path) -> Iterator[logging.Logger]:
    """Send logging and stderr (tqdm writes there) to `path` for the duration of a job, in which
    SIGTERM is handled like SIGINT (`sigterm_as_interrupt`).

    A failing job still writes its traceback to the log, then re-raises so Snakemake fails the job.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    with open(path, "a", buffering=1) as stream, sigterm_as_interrupt():
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)
        old_level = root.level
        root.setLevel(logging.INFO)
        try:
            with contextlib.redirect_stderr(stream):
                yield logging.getLogger("eaglenest")
        except BaseException:
            stream.write(traceback.format_exc())
            # Snakemake shows the job's stderr: keep the message visible there as well.
            traceback.print_exc(file=sys.stderr)
            raise
        finally:
            root.removeHandler(handler)
            root.setLevel(old_level)


def setup_cli_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=LOG_FORMAT)
