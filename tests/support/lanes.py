"""The test lanes, a folder each. `make test` runs every test; `make check`, the quick lane of
development, only those marked neither `snakemake` nor `vllm` nor `slow` (CHECK_LANE).

A lane's folder marks its tests in its conftest (`mark_folder`): tests/workflow/ `snakemake`
(real Snakemake in a temp dir), tests/engine/ `vllm` (a real vLLM from .venv-vllm). Nothing is
inferred at collection. The lanes are held at run time (`guarded`, around every test's setup and
call by tests/conftest.py): a test outside its lane's folder that starts Snakemake or vLLM fails
the moment it tries, before the process exists, with the folder to move it to."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from support.vllm import VLLM_VENV

CHECK_LANE = "not snakemake and not vllm and not slow"
TESTS_DIR = Path(__file__).resolve().parents[1]
SNAKEMAKE = "snakemake"
VLLM = "vllm"
# Where a test that starts each lane's component may live: a workflow test starts Snakemake; an
# engine test may too (the pipeline against a real vLLM), and is the only one to start vLLM.
LANE_FOLDERS = {
    SNAKEMAKE: (TESTS_DIR / "workflow", TESTS_DIR / "engine"),
    VLLM: (TESTS_DIR / "engine",),
}
# vLLM's own modules (`python -m vllm.entrypoints...`). Our engine modules
# (eaglenest.vllm_engine.*) count by the interpreter that runs them: unit tests run them under a
# stand-in interpreter to test the protocol without vLLM.
VLLM_MODULES = ("vllm.",)
# Every test the session collected, before `-m`/`-k` deselect any (stored by tests/conftest.py).
COLLECTED = pytest.StashKey[list]()


class LaneError(RuntimeError):
    """A test started what its folder's lane does not run."""


def mark_folder(items: list[pytest.Item], folder: Path, *marks: pytest.MarkDecorator) -> None:
    """Gives every test under `folder` these marks (a conftest's hook sees every test of the
    session, so it keeps to its own folder)."""
    for item in items:
        if item.path.is_relative_to(folder):
            for mark in marks:
                item.add_marker(mark)


def command_argv(args: str | os.PathLike | Sequence) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        return shlex.split(os.fsdecode(args))
    return [os.fsdecode(a) for a in args]


def command_lanes(args: str | os.PathLike | Sequence) -> set[str]:
    """The lanes a command belongs to: "snakemake" when it runs Snakemake (its program or
    `-m snakemake`, or a command that wraps it: `eaglenest serve-capture -- snakemake ...`),
    "vllm" when vLLM's interpreter or one of its modules runs."""
    argv = command_argv(args)
    lanes = set()
    if any(Path(a).name == SNAKEMAKE for a in argv):
        lanes.add(SNAKEMAKE)
    program = Path(argv[0]) if argv else Path()
    if program.is_relative_to(VLLM_VENV) or any(a.startswith(VLLM_MODULES) for a in argv):
        lanes.add(VLLM)
    return lanes


def misplaced_lanes(test_path: Path, args) -> list[str]:
    """The lanes of `args` that a test at `test_path` may not start."""
    return [
        lane
        for lane in sorted(command_lanes(args))
        if not any(test_path.is_relative_to(folder) for folder in LANE_FOLDERS[lane])
    ]


@contextlib.contextmanager
def guarded(test_path: Path, node_id: str) -> Iterator[None]:
    """Inside the block, a process of a lane `test_path` is not in raises LaneError instead of
    starting (subprocess, and asyncio's subprocesses, which start through it)."""
    original = subprocess.Popen.__init__

    def checked_init(self, args, *rest, **kwargs):
        lanes = misplaced_lanes(test_path, args)
        if lanes:
            folders = " or ".join(
                f"tests/{f.relative_to(TESTS_DIR)}/" for f in LANE_FOLDERS[lanes[0]]
            )
            raise LaneError(
                f"{node_id} starts {lanes[0]} ({shlex.join(command_argv(args))[:200]}): "
                f"a test that starts {lanes[0]} lives in {folders}; move it there"
            )
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = checked_init
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original
