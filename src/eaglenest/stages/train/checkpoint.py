"""The training journal of the `train` stage: checkpoints and metrics that let a killed job resume.

Every `checkpoint_every` steps the journal (results/{run}/journal/train/, outside the rule's
outputs, so Snakemake never deletes it) gets the trainable weights, optimizer, scheduler, step
and RNG states; the batch order is a function of (seed, epoch), so the step number is the data
position. Rerunning the rule after a kill resumes exactly where the last checkpoint was. A
journal written for other inputs or settings (fingerprint) is set aside, not resumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from eaglenest.common.io import atomic_path
from eaglenest.settings.train import TrainSettings
from eaglenest.stages.train.distributed import Processes

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
METRICS_FILE = "metrics.jsonl"


def rng_state() -> dict[str, Any]:
    """Every generator's state in types `torch.load(weights_only=True)` reads (tensors, numbers,
    strings, tuples, lists): a checkpoint is then loaded without unpickling arbitrary objects."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (name, keys.tolist(), pos, has_gauss, cached_gaussian),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def move_aside(path: Path) -> str:
    """Rename a journal file that will not be resumed to `<name>.stale`; return the new name. Every
    rank of a multi-GPU run reads the same file, so one of them may have moved it already."""
    stale = path.with_name(f"{path.name}.stale")
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, stale)
    return stale.name


def load_checkpoint(path: Path, device: str) -> dict[str, Any] | None:
    """The training state at `path`, read with `weights_only=True` (a journal on a shared disk is
    not trusted to run code); None when there is none. A file that cannot be read that way (an
    older format, a foreign or damaged file) is moved aside as `<name>.stale` with a warning, and
    training starts over: the journal only saves time, the outputs never depend on it."""
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location=device, weights_only=True)
    # Objects outside the allowed types and garbage bytes: UnpicklingError; a damaged zip:
    # RuntimeError; a truncated file: EOFError.
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        log.warning(
            "journal %s is not a readable training state (%s): moved to %s",
            path,
            str(err).splitlines()[0][:200],
            move_aside(path),
        )
        return None


def fingerprint(
    settings: TrainSettings, drafter: dict[str, Any], files: Iterable[Path], states: str = ""
) -> str:
    """What a checkpoint is valid for: settings, the drafter (its config and family settings,
    `Recipe.description`) and the inputs' identity; `states`: what computes the states that
    come from the capture servers (hidden.store none/budget)."""
    digest = hashlib.sha256(states.encode())
    unchanging = {k: v for k, v in settings.recorded().items() if k not in ("log_every", "device")}
    digest.update(json.dumps([unchanging, drafter], sort_keys=True).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


class JournaledTraining(Protocol):
    """What the journal saves and restores; `train.Training` has it (described here by shape, so
    that the journal does not import the loop that uses it)."""

    processes: Processes
    model: torch.nn.Module  # with trainable_state_dict()
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    total_steps: int
    fingerprint: str
    tally: Any  # a dataclass of this process's counts since step 0 (feed.SequenceTally)

    @property
    def state_path(self) -> Path: ...


class MetricsLog:
    """metrics.jsonl in the journal; on resume, lines past the checkpoint's step are dropped, and
    so is a torn line (a kill, power loss or full disk mid-write), with a warning: a resume never
    fails on it. The rewrite is atomic, so a kill during it loses no line."""

    def __init__(self, path: Path, keep_until_step: int):
        self.path = path
        kept: list[str] = []
        if path.exists() and keep_until_step > 0:
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                step = _step_of(line)
                if step is None and line.strip():
                    log.warning("%s: line %d is torn or not a record; dropped", path, number)
                elif step is not None and step <= keep_until_step:
                    kept.append(line)
        with atomic_path(path) as tmp:
            tmp.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as stream:
            stream.write(json.dumps(record, sort_keys=True) + "\n")


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def save_checkpoint(training: JournaledTraining, step: int) -> None:
    """Write the training state after `step` to the journal. Every rank takes part (the random
    states of all of them are saved); rank 0 writes."""
    processes = training.processes
    mine = (rng_state(), dataclasses.asdict(training.tally))
    states = [mine]
    if processes.world_size > 1:
        import torch.distributed as dist

        states = [None] * processes.world_size
        dist.all_gather_object(states, mine)
    rngs, tallies = [rng for rng, _ in states], [tally for _, tally in states]
    if not processes.is_main:
        return
    state = {
        "fingerprint": training.fingerprint,
        "step": step,
        "model": training.model.trainable_state_dict(),
        "optimizer": training.optimizer.state_dict(),
        "scheduler": training.scheduler.state_dict(),
        "rng": rngs,
        "tally": tallies,
    }
    with atomic_path(training.state_path) as tmp:
        torch.save(state, tmp)


def resume(training: JournaledTraining) -> int:
    """Load the journal's state into `training` when it was written for the same fingerprint and
    return its step; 0 (start over) when there is none or it is for something else."""
    state_path = training.state_path
    state = load_checkpoint(state_path, training.processes.device)
    if state is None:
        return 0
    if state.get("fingerprint") != training.fingerprint:
        log.warning(
            "journal %s was written for other inputs or settings: moved to %s",
            state_path,
            move_aside(state_path),
        )
        return 0
    training.model.load_state_dict(state["model"], strict=False)
    training.optimizer.load_state_dict(state["optimizer"])
    training.scheduler.load_state_dict(state["scheduler"])
    rank = training.processes.rank
    set_rng_state(state["rng"][min(rank, len(state["rng"]) - 1)])
    tallies = state.get("tally") or []
    if rank < len(tallies):  # a journal written before the tally was kept starts it at 0
        training.tally = type(training.tally)(**tallies[rank])
    log.info("resuming from %s at step %d of %d", state_path, state["step"], training.total_steps)
    return state["step"]
