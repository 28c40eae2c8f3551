"""A hidden-state shard captured by the run's capture servers (`vllm.capture_urls`, each started
by `eaglenest serve-capture`, capture/server.py) instead of an engine of the job's own.

Each sample is one `/v1/completions` request: its token ids as the prompt, `max_tokens` 1,
`return_token_ids`. vLLM answers with `kv_transfer_params.hidden_states_path`, the file our
connector wrote (vllm_engine/connector.py; a `.lock` beside it until the write ends), and the prompt ids
it ran, which must be the ids sent. The job keeps up to `vllm.requests_per_batch` requests in
flight per server, under that cap per server over every job of the host (capture/pool.py, with
client/slots.py as generation's endpoints), so while one shard's last requests finish the next
shard's fill the engines; a server that stops answering has its requests sent to the others. A
file is packed into the shard (vllm_backend.pack_request) and deleted before its slot is freed:
at most the cap of state files exist at once per server.

State files are named by request id, `cmpl-eaglenest-<shard key>-<attempt>-<i>-<send>...`, the
shard key a hash of the output path (capture/state_file.job_key); the job reads and deletes only
files so named (capture/faults.py), in the storage directory each server answers from. A job
removes every leftover of its shard's earlier attempts when it ends (a killed job's last requests
are still written by a server after it died), and on a failure it waits for its requests in
flight and deletes their files before it raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eaglenest.capture.pool import CapturePool, CaptureServerError
from eaglenest.capture.state_file import job_state_files, request_id

log = logging.getLogger(__name__)

PROGRESS_LINES = 10  # per shard, in its log

__all__ = ["CaptureJob", "CaptureServerError", "run_capture"]


@dataclass
class CaptureJob:
    """One shard's requests: sample i is `prompts[i]` (token ids, an int64 array); `pack(i, path)`
    packs and deletes its state file (blocking; run in a thread)."""

    urls: list[str]
    model: str
    prompts: list[np.ndarray]
    pack: Callable[[int, str], None]
    cap: int  # requests in flight per server
    key: str  # capture/state_file.job_key of the shard's output
    wait_s: float = 300.0  # vllm.capture_wait_s
    request_timeout_s: float | None = None  # vllm.capture_request_timeout_s; None: the pool's
    lock_wait_s: float | None = None  # vllm.capture_lock_wait_s
    moves_max: int | None = None  # vllm.capture_moves_max
    slots_dir: Path | None = None
    key_env: str | None = None  # vllm.capture_key_env: the variable holding the servers' key
    attempt: str = field(default_factory=lambda: secrets.token_hex(4))
    storage_dirs: set[str] = field(default_factory=set)
    packed: int = 0
    errors: list[BaseException] = field(default_factory=list)


async def capture_one(pool: CapturePool, job: CaptureJob, i: int) -> None:
    def pack(path: str) -> None:  # in a thread: waits on the file's .lock, packs, deletes
        job.storage_dirs.add(os.path.dirname(path))
        job.pack(i, path)

    await pool.capture(job.prompts[i], request_id(job.key, job.attempt, i), i, pack)


async def worker(pool: CapturePool, job: CaptureJob, todo: list[int]) -> None:
    while todo and not job.errors:
        i = todo.pop()
        try:
            await capture_one(pool, job, i)
        except Exception as err:  # noqa: BLE001 (the others finish what they sent, then it fails)
            job.errors.append(err)
            return
        job.packed += 1
        if job.packed % max(1, len(job.prompts) // PROGRESS_LINES) == 0:
            log.info("captured %d of %d samples", job.packed, len(job.prompts))


def remove_leftovers(job: CaptureJob) -> int:
    """Every state file of this shard in the servers' storage, earlier attempts' included."""
    removed = 0
    for directory in job.storage_dirs:
        for path in job_state_files(directory, job.key):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
    return removed


async def run_capture(job: CaptureJob) -> float:
    """Capture every sample; returns the seconds it took. Raises the first failure, after the
    requests in flight have ended and their files are gone."""
    started = time.perf_counter()
    try:
        pool = CapturePool(
            *(job.urls, job.model, job.cap, job.wait_s, job.slots_dir, job.key_env),
            request_timeout_s=job.request_timeout_s,
            lock_wait_s=job.lock_wait_s,
            moves_max=job.moves_max,
        )
        async with pool:
            todo = list(range(len(job.prompts)))[::-1]  # popped from the end: in shard order
            workers = min(job.cap * len(job.urls), len(todo))
            await asyncio.gather(*(worker(pool, job, todo) for _ in range(workers)))
            log.info("capture servers: %s", pool.summary())
    finally:
        removed = remove_leftovers(job)
        if removed:
            log.info("removed %d state files of earlier attempts at this shard", removed)
    if job.errors:
        raise job.errors[0]
    return time.perf_counter() - started
