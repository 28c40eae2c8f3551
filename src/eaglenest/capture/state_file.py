"""A capture server's per-request state file (vLLM's hidden-states KV connector writes one per
request, our CPU variant in vllm_engine/connector.py): read once vLLM has finished writing it,
then deleted. vLLM takes the file's `.lock` before it answers and frees it once the file is
written, or when its process ends; a file missing or torn after the wait was lost with its
server (StateFileLost), and the capture pool sends the sample to another (capture/pool.py). The
wait is bounded (LOCK_WAIT_S): a server that answered and then hung holding the lock (a stuck
collective, SIGSTOP) has its sample sent to another too (StateFileHung), instead of blocking the
job, or a training that reads from the servers, forever.

A capture job (a shard's capture, a reader of pooled states) names its requests
`eaglenest-<job key>-<attempt>-<n>`, so the servers' state files are
`cmpl-eaglenest-<job key>-...`: the key is the same for every attempt of the job, so that its end
removes what its killed attempts left (a killed job's last requests are still written by a server
after it died).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eaglenest.capture.faults import ServerFault

# How long a state file's lock may be held after the server answered: the write of one sample's
# states (~0.7 GB for 16K tokens of Kimi-K2.5) to the storage, with room for a slow filesystem.
LOCK_WAIT_S = 120.0
LOCK_POLL_S = 0.02


def job_key(path: str | Path, rank: str | None = None) -> str:
    """A capture job's key: a hash of a path of the job's own (a shard's output, a reader's
    journal) and, for a process of a torchrun job, its rank (each its own, so that one's end
    never removes another's files)."""
    name = str(Path(path).resolve()) if rank is None else f"{Path(path).resolve()}:{rank}"
    return hashlib.sha256(name.encode()).hexdigest()[:12]


def request_id(key: str, attempt: str, n: int) -> str:
    """The id of a job's `n`th request of an attempt (vLLM's state file: `cmpl-<id>...`)."""
    return f"eaglenest-{key}-{attempt}-{n}"


def job_state_files(directory: str | Path, key: str) -> Iterator[Path]:
    """The state files (and their locks) of every attempt of a job in a server's storage."""
    return Path(directory).glob(f"cmpl-eaglenest-{key}-*")


class StateFileLost(ServerFault, OSError):
    """A server answered, then ended before its state file was whole (killed between the answer
    and the write): the sample must be asked again, of a server that answers."""


class StateFileHung(StateFileLost):
    """A server answered, then held its state file's lock past LOCK_WAIT_S (hung)."""


def wait_written(path: str, timeout_s: float | None = None) -> None:
    """Until vLLM frees `path`'s lock (the file written, or its process gone); StateFileHung
    after `timeout_s` (LOCK_WAIT_S)."""
    timeout_s = LOCK_WAIT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(FileNotFoundError), open(path + ".lock") as stream:
        while True:
            try:
                fcntl.flock(stream, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StateFileHung(
                        f"{path}: the server still held the state file's lock {timeout_s:g} s "
                        "after it answered (hung)"
                    ) from None
                time.sleep(LOCK_POLL_S)


def read_request_file(path: str, lock_wait_s: float | None = None) -> dict[str, torch.Tensor]:
    """One request's states once vLLM has finished writing them, then the file and its lock are
    deleted. vLLM takes the lock before it answers and frees it once the file is written, or
    when its process ends: a file missing or torn after the wait was lost with the server."""
    lock = path + ".lock"
    wait_written(path, lock_wait_s)
    try:
        states = load_file(path)
    except (FileNotFoundError, SafetensorError) as err:
        raise StateFileLost(f"{path}: the state file is missing or torn ({err})") from err
    for name in (path, lock):
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)
    return states


def remove_state_file(path: str) -> None:
    """A state file and its lock, gone (either may be gone already)."""
    for name in (path, path + ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)
