"""A capture server's per-request state file (vLLM's hidden-states KV connector writes one per
request, our CPU variant in vllm_engine/connector.py): read once vLLM has finished writing it,
then deleted. vLLM takes the file's `.lock` before it answers and frees it once the file is
written, or when its process ends; a file missing or torn after the wait was lost with its
server (StateFileLost), and the capture pool sends the sample to another (capture/pool.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


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
