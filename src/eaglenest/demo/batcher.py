"""The dynamic batcher behind `eaglenest serve`: generation in batches on one thread.

One batcher thread owns the model. It waits for a request, gathers whatever else arrives within a
few milliseconds (up to `max_batch_size`), left-pads the prompts and runs a KV-cached decode loop
over the batch. Each row has its own sampling parameters and torch.Generator, and leaves the batch
as soon as it stops, so a short answer is not held back by a long one and finished rows cost
nothing. A request that arrives while a batch runs joins it at the next step: it is prefilled
alone and its keys and values are added as a new row, left-padded to the batch's length, so a
prompt that missed the gathering window by a millisecond does not wait for the batch's longest
answer (with the long demo's answers of 9,000 tokens, that wait doubled a shard's time). A
prompt longer than the batch so far is held until the batch is as long, or the next batch.

Results go back to the aiohttp event loop with `loop.call_soon_threadsafe`, so the HTTP side
stays a plain `await batcher.generate(...)`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from eaglenest.target_model.kv_cache import GrowingLayer, growing_cache

log = logging.getLogger(__name__)

# Seeds of requests that sent none: drawn from the OS so concurrent unseeded requests differ.
_SYSTEM_RANDOM = random.SystemRandom()


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class GenerationResult:
    # Includes the stop token when finish_reason is "stop", as vLLM returns it.
    completion_token_ids: list[int]
    finish_reason: str  # "stop" or "length"


@dataclass
class _Pending:
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else _SYSTEM_RANDOM.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)

    def resolve(self, result: GenerationResult | None = None, error: BaseException | None = None):
        self.loop.call_soon_threadsafe(_set_future, self.future, result, error)


def _set_future(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    # The handler may have been cancelled (client gone) while the batch ran.
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass
class BatcherStats:
    batches: int = 0
    requests: int = 0
    generated_tokens: int = 0
    max_batch_size_seen: int = 0


_STOP = object()  # queue sentinel that ends the batcher thread


class Batcher:
    """Owns a causal LM and serves generation requests in dynamic batches from one thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        stop_token_ids: set[int],
        pad_token_id: int,
        *,
        max_batch_size: int = 64,
        gather_window_s: float = 0.005,
    ) -> None:
        if not stop_token_ids:
            raise ValueError("the batcher needs at least one stop token id (end of turn / eos)")
        self.model = model
        self.stop_token_ids = frozenset(stop_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.gather_window_s = gather_window_s
        self.stats = BatcherStats()
        self.device = next(model.parameters()).device
        # Computing logits only for the last position saves a [B, T, V] tensor at prefill; models
        # loaded with trust_remote_code may not accept the argument.
        forward_parameters = inspect.signature(model.forward).parameters
        self._keeps_last_logits = "logits_to_keep" in forward_parameters
        # transformers 5 renamed `past_key_values` to `cache`; remote-code models keep the old name.
        self._cache_argument = "cache" if "cache" in forward_parameters else "past_key_values"
        self._queue: queue.Queue = queue.Queue()
        self._held: list[_Pending] = []  # taken to join a batch they were too long for
        self._thread = threading.Thread(target=self._serve_forever, name="eaglenest-batcher")
        self._thread.daemon = True

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def waiting(self) -> int:
        """Requests queued for a batch (not yet generating)."""
        return self._queue.qsize() + len(self._held)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> GenerationResult:
        """Queue one request and wait for its result (called on the event loop)."""
        loop = asyncio.get_running_loop()
        pending = _Pending(list(prompt_token_ids), params, loop, loop.create_future())
        self._queue.put(pending)
        return await pending.future

    # -- batcher thread -----------------------------------------------------------------------

    def _serve_forever(self) -> None:
        while True:
            batch = self._gather_batch()
            if batch is None:
                return
            try:
                with torch.inference_mode():
                    self._run_batch(batch)
            except Exception as error:  # a failing batch must not kill the batcher
                log.exception("generation failed for a batch of %d requests", len(batch))
                for pending in batch:
                    pending.resolve(error=RuntimeError(f"generation failed: {error}"))

    def _gather_batch(self) -> list[_Pending] | None:
        batch, self._held = self._held[: self.max_batch_size], self._held[self.max_batch_size :]
        if not batch:
            first = self._queue.get()
            if first is _STOP:
                return None
            batch = [first]
        deadline = time.monotonic() + self.gather_window_s
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                item = (
                    self._queue.get(timeout=remaining)
                    if remaining > 0
                    else self._queue.get_nowait()
                )
            except queue.Empty:
                break
            if item is _STOP:
                self._queue.put(_STOP)  # finish this batch, then stop
                break
            batch.append(item)
        return batch

    def _run_batch(self, batch: list[_Pending]) -> None:
        self.stats.batches += 1
        self.stats.requests += len(batch)
        self.stats.max_batch_size_seen = max(self.stats.max_batch_size_seen, len(batch))
        input_ids, attention_mask = self._left_pad([p.prompt_token_ids for p in batch])
        # Left padding shifts every row; positions count real tokens only.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = growing_cache(self.model)
        # A sliding-window model's cache keeps other layers: its requests wait for the next batch.
        joinable = all(isinstance(layer, GrowingLayer) for layer in cache.layers)
        active = list(range(len(batch)))  # batch indices of rows still generating
        completions: list[list[int]] = [[] for _ in batch]
        step_input = input_ids
        while True:
            logits = self._forward(step_input, attention_mask, position_ids, cache)
            next_tokens = _sample(logits, [batch[i] for i in active])
            still_running = []
            for row, index in enumerate(active):
                token = int(next_tokens[row])
                completions[index].append(token)
                if token in self.stop_token_ids:
                    batch[index].resolve(GenerationResult(completions[index], "stop"))
                elif len(completions[index]) >= batch[index].params.max_new_tokens:
                    batch[index].resolve(GenerationResult(completions[index], "length"))
                else:
                    still_running.append(row)
            self.stats.generated_tokens += len(active)
            if not still_running:
                return
            if len(still_running) < len(active):
                keep = torch.tensor(still_running, device=self.device)
                cache.batch_select_indices(keep)
                attention_mask, position_ids = attention_mask[keep], position_ids[keep]
                next_tokens = next_tokens[keep]
                active = [active[row] for row in still_running]
            step_input = next_tokens.unsqueeze(1)
            position_ids = position_ids[:, -1:] + 1
            room = self.max_batch_size - len(active)
            joined = self._join(batch, completions, cache, room) if joinable else None
            if joined is not None:
                mask, positions, tokens = joined
                active += range(len(batch) - len(tokens), len(batch))
                attention_mask = torch.cat([attention_mask, mask])
                position_ids = torch.cat([position_ids, positions])
                step_input = torch.cat([step_input, tokens.unsqueeze(1)])
                self.stats.max_batch_size_seen = max(self.stats.max_batch_size_seen, len(active))
            ones = attention_mask.new_ones((len(active), 1))
            attention_mask = torch.cat([attention_mask, ones], dim=1)

    def _join(
        self, batch: list[_Pending], completions: list[list[int]], cache: DynamicCache, room: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Requests waiting in the queue, prefilled and added to a running batch as new rows of
        `batch`, `completions` and `cache`: (their attention mask over the cache's length, their
        next positions, their first tokens), or None when none joined. A request whose first
        token ends it is answered here and not added."""
        length = cache.get_seq_length()
        joiners = [p for p in self._held if len(p.prompt_token_ids) <= length][:room]
        self._held = [p for p in self._held if p not in joiners]
        while len(joiners) < room:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                self._queue.put(_STOP)
                break
            (joiners if len(item.prompt_token_ids) <= length else self._held).append(item)
        if not joiners:
            return None
        self.stats.requests += len(joiners)
        input_ids, mask = self._left_pad([p.prompt_token_ids for p in joiners])
        own = growing_cache(self.model)
        logits = self._forward(input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), own)
        first = _sample(logits, joiners)
        staying = []
        for row, pending in enumerate(joiners):
            token = int(first[row])
            self.stats.generated_tokens += 1
            if token in self.stop_token_ids:
                pending.resolve(GenerationResult([token], "stop"))
            elif pending.params.max_new_tokens <= 1:
                pending.resolve(GenerationResult([token], "length"))
            else:
                staying.append(row)
        if not staying:
            return None
        keep = torch.tensor(staying, device=self.device)
        own.batch_select_indices(keep)
        for layer, rows in zip(cache.layers, own.layers, strict=True):
            layer.add_rows(rows)
        batch += [joiners[row] for row in staying]
        completions += [[int(first[row])] for row in staying]
        padded = mask.new_zeros((len(staying), length))
        padded[:, length - mask.shape[1] :] = mask[keep]
        positions = torch.tensor([[len(joiners[row].prompt_token_ids)] for row in staying])
        return padded, positions.to(self.device), first[keep]

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        extra = {self._cache_argument: cache}
        if self._keeps_last_logits:
            extra["logits_to_keep"] = 1
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **extra,
        )
        return output.logits[:, -1, :].float()


def _sample(logits: torch.Tensor, rows: list[_Pending]) -> torch.Tensor:
    """Pick one token per row: greedy when temperature is 0, else temperature + top-p sampling
    drawn from the row's own generator (so a seeded request does not depend on its neighbours'
    draws)."""
    tokens = logits.argmax(dim=-1)
    sampled_rows = [row for row, p in enumerate(rows) if p.params.temperature > 0]
    if not sampled_rows:
        return tokens
    index = torch.tensor(sampled_rows, device=logits.device)
    temperature = torch.tensor(
        [rows[row].params.temperature for row in sampled_rows], device=logits.device
    )
    top_p = torch.tensor([rows[row].params.top_p for row in sampled_rows], device=logits.device)
    probs = torch.softmax(logits[index] / temperature[:, None], dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    for k, row in enumerate(sampled_rows):
        # Generators live on the CPU; sampling there keeps them independent of the device.
        choice = torch.multinomial(sorted_probs[k].cpu(), 1, generator=rows[row].generator)
        tokens[row] = sorted_ids[k, choice.to(sorted_ids.device)].squeeze()
    return tokens
