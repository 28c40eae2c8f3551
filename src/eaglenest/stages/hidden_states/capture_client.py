"""A hidden-state shard captured by a long-lived capture server (`vllm.capture_url`, started by
`eaglenest serve-capture`, capture_server.py) instead of an engine of the job's own.

Each sample is one `/v1/completions` request: its token ids as the prompt, `max_tokens` 1,
`return_token_ids`. vLLM answers with `kv_transfer_params.hidden_states_path`, the file our
connector wrote (vllm_engine/connector.py; a `.lock` beside it until the write ends), and the prompt ids
it ran, which must be the ids sent. The job keeps up to `vllm.requests_per_batch` requests in
flight, under that cap per server over every job of the host (client/slots.py, as generation's
endpoints), so while one shard's last requests finish the next shard's fill the engine. A file
is packed into the shard (vllm_backend.pack_request) and deleted before its slot is freed: at
most the cap of state files exist at once.

State files are named by request id, `cmpl-eaglenest-<shard key>-<attempt>-<i>-...`, the shard key
a hash of the output path: a job removes every leftover of its shard's earlier attempts when it
ends (a killed job's last requests are still written by the server after it died), and on a
failure it waits for its requests in flight and deletes their files before it raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from eaglenest.client.retry import RETRYABLE_STATUS, RetryPolicy
from eaglenest.client.slots import POLL_S, EndpointSlots
from eaglenest.client.urls import api_base, endpoint_path

log = logging.getLogger(__name__)

# Per request: a server restarting between shards is not a reason to fail a shard.
CAPTURE_RETRY = RetryPolicy(max_attempts=3, backoff_base_s=1.0, backoff_max_s=4.0)
REQUEST_TIMEOUT_S = 600  # one prompt's forward pass; a 32K-token sample takes seconds on a GPU
PROGRESS_LINES = 10  # per shard, in its log


class CaptureServerError(RuntimeError):
    """The capture server is unreachable, serves another capture, or answered wrongly."""


def shard_key(out: str | Path) -> str:
    return hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:12]


@dataclass
class CaptureJob:
    """One shard's requests: sample i is `prompts[i]` (token ids, an int64 array); `pack(i, path)`
    packs and deletes its state file (blocking; run in a thread)."""

    url: str
    model: str
    prompts: list[np.ndarray]
    pack: Callable[[int, str], None]
    cap: int
    key: str
    slots_dir: Path | None = None
    attempt: str = field(default_factory=lambda: secrets.token_hex(4))
    storage_dirs: set[str] = field(default_factory=set)
    packed: int = 0
    errors: list[BaseException] = field(default_factory=list)
    waiting: int = 0  # workers waiting for a slot


async def acquire(job: CaptureJob, slots: EndpointSlots) -> int:
    """A request slot under the server's cap over every job of the host; while any worker of
    this job waits, the job is marked waiting, so older jobs (earlier shards) go first."""
    job.waiting += 1
    try:
        while (index := slots.try_acquire()) is None:
            slots.set_waiting(True)
            await asyncio.sleep(POLL_S)
        return index
    finally:
        job.waiting -= 1
        if not job.waiting:
            slots.set_waiting(False)


async def check_server(session: aiohttp.ClientSession, url: str, model: str) -> None:
    try:
        async with session.get(endpoint_path(url, "/v1/models")) as response:
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        raise CaptureServerError(
            f"vllm.capture_url {url}: no capture server answers ({err!r}); start one with "
            "`eaglenest serve-capture` and the run's config"
        ) from err
    served = [m.get("id") for m in body.get("data") or []]
    if model not in served:
        raise CaptureServerError(
            f"vllm.capture_url {url} serves {served}, not {model}: it was started for another "
            "target, dtype, engine arguments or aux layers than this run's; start "
            "`eaglenest serve-capture` with this run's config"
        )


async def post_sample(session: aiohttp.ClientSession, job: CaptureJob, i: int) -> dict:
    body = {
        "model": job.model,
        "prompt": job.prompts[i].tolist(),
        "max_tokens": 1,
        "temperature": 0.0,
        "return_token_ids": True,
        "request_id": f"eaglenest-{job.key}-{job.attempt}-{i}",
    }
    for attempt in range(1, CAPTURE_RETRY.max_attempts + 1):
        try:
            async with session.post(endpoint_path(job.url, "/v1/completions"), json=body) as r:
                text = await r.text()
                if r.status == 200:
                    return json.loads(text)
                if r.status not in RETRYABLE_STATUS or not CAPTURE_RETRY.retries(attempt):
                    raise CaptureServerError(f"sample row {i}: HTTP {r.status}: {text[:500]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            if not CAPTURE_RETRY.retries(attempt):
                raise CaptureServerError(f"sample row {i}: {type(err).__name__}: {err}") from err
        await asyncio.sleep(CAPTURE_RETRY.backoff_s(attempt))
    raise AssertionError("unreachable")


def answered_path(answer: dict, sent, i: int) -> str:
    """The state file of an answer, once its prompt ids are checked against those sent."""
    choices = answer.get("choices") or [{}]
    returned = choices[0].get("prompt_token_ids")
    if returned is None:
        returned = answer.get("prompt_token_ids")
    if returned is not None and list(returned) != sent.tolist():
        raise CaptureServerError(
            f"sample row {i}: the server ran other prompt ids than were sent "
            f"({len(returned)} vs {len(sent)} tokens)"
        )
    path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise CaptureServerError(
            f"sample row {i}: the answer has no kv_transfer_params.hidden_states_path: the "
            "server is not a capture server (extract_hidden_states and a KV connector)"
        )
    return path


def remove_state_file(path: str) -> None:
    for name in (path, path + ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)


async def capture_one(session, job: CaptureJob, slots: EndpointSlots, i: int) -> None:
    slot = await acquire(job, slots)
    path = None
    try:
        path = answered_path(await post_sample(session, job, i), job.prompts[i], i)
        job.storage_dirs.add(os.path.dirname(path))
        await asyncio.to_thread(job.pack, i, path)  # waits on the .lock, packs, deletes
    finally:
        if path is not None:
            remove_state_file(path)  # packed or not: a failed job leaves none of its files
        slots.release(slot)


async def worker(session, job: CaptureJob, slots: EndpointSlots, todo: list[int]) -> None:
    while todo and not job.errors:
        i = todo.pop()
        try:
            await capture_one(session, job, slots, i)
        except Exception as err:  # noqa: BLE001 (the others finish what they sent, then it fails)
            job.errors.append(err)
            return
        job.packed += 1
        if job.packed % max(1, len(job.prompts) // PROGRESS_LINES) == 0:
            log.info("captured %d of %d samples", job.packed, len(job.prompts))


def remove_leftovers(job: CaptureJob) -> int:
    """Every state file of this shard in the server's storage, earlier attempts' included."""
    removed = 0
    for directory in job.storage_dirs:
        for path in Path(directory).glob(f"cmpl-eaglenest-{job.key}-*"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
    return removed


async def run_capture(job: CaptureJob) -> float:
    """Capture every sample; returns the seconds it took. Raises the first failure, after the
    requests in flight have ended and their files are gone."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, connect=10)
    connector = aiohttp.TCPConnector(limit=job.cap + 1, limit_per_host=0)
    slots = EndpointSlots(api_base(job.url), job.cap, job.slots_dir)
    started = time.perf_counter()
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await check_server(session, job.url, job.model)
            todo = list(range(len(job.prompts)))[::-1]  # popped from the end: in shard order
            workers = min(job.cap, len(todo))
            await asyncio.gather(*(worker(session, job, slots, todo) for _ in range(workers)))
    finally:
        slots.close()
        removed = remove_leftovers(job)
        if removed:
            log.info("removed %d state files of earlier attempts at this shard", removed)
    if job.errors:
        raise job.errors[0]
    return time.perf_counter() - started
