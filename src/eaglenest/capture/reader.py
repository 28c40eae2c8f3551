"""Hidden states asked of the run's capture servers by the jobs that read them (`hidden.store`
none, and budget's shards that are not stored): training and evaluation, instead of files.

    states = PooledStates.of_job(hidden, runtime, job_path, pooled_tokens, batch_tokens)
    shards = open_pooled_shards(states, pooled_tokens, head, vocab)  # read as HiddenShards are
    ask_ahead(shards, order)  # the samples in the order they will be read: asked ahead
    ...                       # shard.sample(i) as HiddenShard.sample(i) of the file, exactly
    states.close()

The pool is the capture stage's (capture/pool.py): the same `vllm.capture_urls`,
served-name check, per-server caps, retries and wait for a server to come back. Each answer is
packed by the capture stage's own functions (capture/answer.request_rows, then
formats/hidden_shard.stored_rows, and loaded_rows when read): rounded to the storage dtype (fp8
included) and with the same target signal (capture/final_signal.py) as a file would hold,
so training from the servers equals training from files.
Nothing hidden-state-shaped is written by this job; the servers' own per-request state files,
vLLM's transport to us (vllm_engine/connector.py), are read and deleted as in the capture stage,
at most the servers' caps of them at once.

Ahead: `follow` walks the order of the samples to come in a thread, keeping samples of up to
`ahead_tokens` tokens asked for (in flight, or answered and held in their storage dtype, fp8 as
fp8, until read; at least one sample): the reader's memory bounds it, not the servers' slots
(one 16K-token sample of Kimi-K2.5 is ~0.7 GB in bf16). The readers ask for AHEAD_BATCHES of
their batches' tokens. A sample read outside that order is asked for when it is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import secrets
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglenest.capture.answer import ExpectedStates, check_states, request_rows
from eaglenest.capture.final_signal import FinalSignal
from eaglenest.capture.request import capture_engine_request, served_name
from eaglenest.capture.state_file import (
    job_key,
    job_state_files,
    read_request_file,
    remove_state_file,
    request_id,
)
from eaglenest.formats.hidden_shard import loaded_rows, stored_rows
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.target_model.files import resolve_target_dir
from eaglenest.target_model.loading import checked_aux_layer_ids, load_text_config

log = logging.getLogger(__name__)

AHEAD_BATCHES = 4  # batches' worth of tokens a reader asks ahead (train/evaluate max_batch_tokens)
_END = object()


def stored_answer(
    frame,
    i: int,
    path: str,
    signal,
    dtype: str,
    n_aux: int,
    tokens: Path,
    expected: ExpectedStates | None = None,
) -> dict[str, torch.Tensor]:
    """Sample `i` of a tokens frame from the state file a capture server wrote for it (read, then
    deleted): its tensors as a hidden-state file would store them (the capture stage's own
    functions: request_rows, stored_rows). A file that is not what `expected` calls for raises
    StateFileError first: the pool sends the sample to another server."""
    states = read_request_file(path)
    if expected is not None:
        check_states(states, expected, frame["input_ids"][i].to_numpy(), path)
    aux, target, ids, mask = request_rows(frame, i, states, signal, tokens)
    return stored_rows(aux, target, ids, mask, dtype, n_aux)


class PooledShard:
    """A tokens shard whose states come from the capture servers, read as a HiddenShard."""

    def __init__(self, states: PooledStates, tokens: str | Path, number: int):
        self.states, self.number, self.path = states, number, Path(tokens)
        # Here, not at the top: polars and pandera are not on a GPU training machine either.
        from eaglenest.formats.tokens import read_tokens

        self.frame = read_tokens(tokens)
        offsets = np.zeros(len(self.frame) + 1, dtype=np.int64)
        np.cumsum(self.frame["n_tokens"].to_numpy(), out=offsets[1:])
        self.offsets = torch.from_numpy(offsets)
        self.aux_layer_ids = list(states.layer_ids)
        self.hidden_size = int(states.model_config.hidden_size)
        self.prompts = [np.asarray(ids, dtype=np.int64) for ids in self.frame["input_ids"]]

    @property
    def sample_ids(self) -> list[str]:
        return self.frame["id"].to_list()

    def __len__(self) -> int:
        return len(self.prompts)

    def length(self, i: int) -> int:
        return len(self.prompts[i])

    def sample(self, i: int, spans: list[tuple[int, int]] | None = None) -> dict[str, torch.Tensor]:
        """As HiddenShard.sample: the servers capture the whole sample, `spans` cut it."""
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: sample {i} out of range [0, {len(self)})")
        rows = self.states.take(self, i)
        if spans is None:
            return rows
        return {n: torch.cat([t[a:b] for a, b in spans]) for n, t in rows.items()}

    def prompt_len(self, i: int) -> int:
        return int(self.frame["prompt_len"][i])

    def check(self, field: str, expected: Any, found: Any) -> None:
        if expected is not None and expected != found:
            raise ValueError(f"{self.path}: field {field}: expected {expected!r}, found {found!r}")


class Stream:
    """Samples asked for in the order they will be read, at most `ahead_tokens` unread at once
    (at least one sample)."""

    def __init__(self, states: PooledStates, refs: Iterable[tuple[PooledShard, int]], ahead: int):
        self.queue: queue.Queue = queue.Queue()
        self.ahead, self.held = ahead, 0
        self.room = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._fill, args=(states, refs), daemon=True)

    def _fill(self, states: PooledStates, refs: Iterable[tuple[PooledShard, int]]) -> None:
        try:
            for shard, i in refs:
                n = shard.length(i)
                with self.room:
                    self.room.wait_for(
                        lambda n=n: self.closed or not self.held or self.held + n <= self.ahead
                    )
                    if self.closed:
                        return
                    self.held += n
                self.queue.put((shard.number, i, states.submit(shard, i)))
        except Exception as err:  # noqa: BLE001 (re-raised where the sample is read)
            self.queue.put(err)
        self.queue.put(_END)

    def take(self, shard: PooledShard, i: int) -> Future:
        item = self.queue.get()
        if isinstance(item, Exception):
            raise item
        if item is _END or item[:2] != (shard.number, i):
            raise RuntimeError(
                f"{shard.path}: sample {i} was read out of the order it was asked for in"
            )
        with self.room:
            self.held -= shard.length(i)
            self.room.notify_all()
        return item[2]

    def close(self) -> None:
        with self.room:
            self.closed = True
            self.room.notify_all()
        with contextlib.suppress(queue.Empty):
            while True:
                item = self.queue.get_nowait()
                if isinstance(item, tuple):
                    item[2].cancel()


class PooledStates:
    """The capture pool in an event loop of its own thread, for the jobs that read states."""

    def __init__(
        self,
        settings: HiddenSettings,
        runtime: VllmRuntime,
        key: str,
        ahead_tokens: int,
    ):
        if not runtime.capture_urls:
            raise ValueError("hidden.store none/budget: vllm.capture_urls names no capture server")
        target = settings.target
        self.settings, self.runtime, self.key = settings, runtime, key
        target_dir = resolve_target_dir(target.path)
        self.model_config = load_text_config(target.path, target.trust_remote_code)
        n_layers = self.model_config.num_hidden_layers
        self.layer_ids = checked_aux_layer_ids(self.model_config, settings)
        self.signal = FinalSignal(target_dir, self.model_config, settings)
        request = capture_engine_request(
            target_dir=target_dir,
            layer_ids=[*self.layer_ids, n_layers],
            settings=settings,
            runtime=runtime,
            work_dir=Path("."),  # not sent: the servers keep their own storage
            longest=0,
            trust_remote_code=target.trust_remote_code,
        )
        self.model = served_name(request)  # as capture_through_server checks it
        self.expected = ExpectedStates.of(
            len(self.layer_ids) + 1,
            self.model_config.hidden_size,
            settings.model_dtype,
            settings.engine.engine_args if settings.engine else {},
        )
        self.ahead = ahead_tokens
        self.attempt = secrets.token_hex(4)
        self.counter = itertools.count()
        self.storage_dirs: set[str] = set()
        self.shards: list[PooledShard] = []
        self.streams: dict[int, Stream] = {}
        self.answered = 0
        # Here, not at the top: training and evaluation import this module in every mode, and
        # the pool's HTTP client (aiohttp) is not on a GPU training machine that reads files.
        from eaglenest.capture.pool import CapturePool
        from eaglenest.settings.urls import redacted_url

        self.pool = CapturePool(  # before the loop's thread: a missing key leaves no thread
            list(runtime.capture_urls),
            self.model,
            runtime.requests_per_batch,
            runtime.capture_wait_s,
            Path(runtime.slots_dir) if runtime.slots_dir else None,
            runtime.capture_key_env,
            request_timeout_s=runtime.capture_request_timeout_s,
            lock_wait_s=runtime.capture_lock_wait_s,
            moves_max=runtime.capture_moves_max,
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="pool")
        self.thread.start()
        try:
            self._run(self.pool.__aenter__())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        log.info(
            "states from the capture servers %s (%s), up to %d tokens asked ahead",
            ", ".join(redacted_url(url) for url in runtime.capture_urls),
            self.model,
            self.ahead,
        )

    @classmethod
    def of_job(
        cls,
        settings: HiddenSettings | None,
        runtime: VllmRuntime | None,
        job: str | Path,
        pooled: list,
        batch_tokens: int,
    ) -> PooledStates | None:
        """The states of a job (named by a path of its own: its journal, its output) that reads
        the `pooled` tokens shards from the capture servers in batches of `batch_tokens`; None
        when it reads none."""
        if not pooled:
            return None
        if settings is None or runtime is None:
            raise ValueError("shards from the capture servers need the hidden and vllm settings")
        key = job_key(job, rank=os.environ.get("RANK", "0"))
        return cls(settings, runtime, key, AHEAD_BATCHES * batch_tokens)

    @property
    def identity(self) -> str:
        """What computes these states (the servers' name hashes the engine's side, the settings
        ours): a journal resumes only with the same."""
        return f"{self.model} {self.settings.to_json()}"

    def _run(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def shard(self, tokens: str | Path) -> PooledShard:
        shard = PooledShard(self, tokens, len(self.shards))
        self.shards.append(shard)
        return shard

    # --- asking -------------------------------------------------------------------------------

    def submit(self, shard: PooledShard, i: int) -> Future:
        return asyncio.run_coroutine_threadsafe(self._capture(shard, i), self.loop)

    async def _capture(self, shard: PooledShard, i: int) -> dict[str, torch.Tensor]:
        def pack(path: str) -> dict[str, torch.Tensor]:
            self.storage_dirs.add(str(Path(path).parent))
            return self._pack(shard, i, path)

        sent = request_id(self.key, self.attempt, next(self.counter))
        rows = await self.pool.capture(shard.prompts[i], sent, i, pack)
        self.answered += 1
        return rows

    def _pack(self, shard: PooledShard, i: int, path: str) -> dict[str, torch.Tensor]:
        n_aux = len(shard.aux_layer_ids)
        # Held as stored (fp8 as fp8) until read: the memory of what is asked ahead.
        return stored_answer(
            shard.frame, i, path, self.signal, self.settings.dtype, n_aux, shard.path, self.expected
        )

    def follow(self, refs: Iterable[tuple[PooledShard, int]], shards: Iterable[PooledShard]):
        """Ask ahead for `refs` (samples of `shards`, in the order they will be read)."""
        stream = Stream(self, refs, self.ahead)
        for shard in shards:
            old = self.streams.get(shard.number)
            if old is not None:
                old.close()
            self.streams[shard.number] = stream
        stream.thread.start()

    def take(self, shard: PooledShard, i: int) -> dict[str, torch.Tensor]:
        stream = self.streams.get(shard.number)

        future = stream.take(shard, i) if stream is not None else self.submit(shard, i)
        return loaded_rows(future.result())

    # --- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        for stream in set(self.streams.values()):
            stream.close()
        try:
            self._run(self.pool.__aexit__(None, None, None))
            log.info("capture servers: %s", self.pool.summary())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """State files of this job's earlier attempts (a killed job's last requests are written
        by the servers after it died) and of requests cancelled at the end."""
        for directory in self.storage_dirs:
            for path in job_state_files(directory, self.key):
                if not path.name.endswith(".lock"):
                    remove_state_file(str(path))


def pooled_refs(order: Iterable, shards: list) -> Iterable[tuple[PooledShard, int]]:
    """The samples of `order` (lists of SampleRef, batch by batch) that come from the pool."""
    for refs in order:
        for ref in refs:
            shard = shards[ref.shard]
            if isinstance(shard, PooledShard):
                yield shard, ref.index


def ask_ahead(shards: list, order: list) -> None:
    """Before reading `order` (lists of SampleRef, batch by batch, into `shards`): ask the pool
    for its pooled samples in that order; nothing when every shard is a file."""
    pooled = [s for s in shards if isinstance(s, PooledShard)]
    if pooled:
        pooled[0].states.follow(pooled_refs(order, shards), pooled)


def open_pooled_shards(states: PooledStates | None, tokens, head, vocab) -> list[PooledShard]:
    """The pooled shards of these tokens shards, checked as open_shards checks files."""
    if states is None:
        return []
    shards = [states.shard(path) for path in tokens]
    for shard in shards:
        shard.check("aux_layer_ids", list(head.aux_layer_ids), shard.aux_layer_ids)
        shard.check("hidden_size", head.hidden_size, shard.hidden_size)
    return shards
