"""A capture server's per-request state file (vLLM's hidden-states KV connector writes one per
request, our CPU variant in vllm_engine/connector.py): read once vLLM has finished writing it,
then deleted. vLLM takes the file's `.lock` before it answers and frees it once the file is
written, or when its process ends; a file missing or torn after the wait was lost with its
server (StateFileLost), and the capture pool sends the sample to another (capture/pool.py).

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
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


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


class StateFileLost(OSError):
    """A server answered, then ended before its state file was whole (killed between the answer
    and the write): the sample must be asked again, of a server that answers."""


def read_request_file(path: str) -> dict[str, torch.Tensor]:
    """One request's states once vLLM has finished writing them, then the file and its lock are
    deleted. vLLM takes the lock before it answers and frees it once the file is written, or
    when its process ends: a file missing or torn after the wait was lost with the server."""
    lock = path + ".lock"
    with contextlib.suppress(FileNotFoundError), open(lock) as stream:
        fcntl.flock(stream, fcntl.LOCK_SH)
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
