"""What each training step trains on: the batches of this process for every step from any step
on (a function of the seed and the epoch, so a resumed run gets the batches the killed one would
have), built ahead in a thread, with the aux noise of train.aux_noise."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from eaglenest.drafter.batches import (
    Batch,
    BatchPlan,
    SampleRef,
    batch_positions,
    build_batch,
    build_packed_batch,
)
from eaglenest.stages.train.distributed import Processes, all_reduce_max, all_reduce_sum


@dataclass
class SequenceTally:
    """What the batches of this process held since step 0 (train_report.json's
    `max_position_trained` and `sequence.tokens_trained`): checkpointed, so a resumed run
    reports the whole run's."""

    max_position: int = -1  # the largest rotary position of a token
    tokens: int = 0  # the samples' tokens, padding aside

    def add(self, batch: Batch) -> None:
        held = batch.token_mask
        if held is None:  # a batch built by hand: every position holds a token
            held = torch.ones_like(batch.input_ids, dtype=torch.bool)
        positions = batch_positions(batch)
        if bool(held.any()):
            self.max_position = max(self.max_position, int(positions[held].max()))
        self.tokens += int(held.sum())

    def over(self, processes: Processes) -> SequenceTally:
        """The tally of every process (every one calls this)."""
        (largest,) = all_reduce_max([self.max_position], processes)
        (tokens,) = all_reduce_sum([float(self.tokens)], processes)
        return SequenceTally(int(largest), round(tokens))


def with_aux_noise(batch: Batch, noise: float, seed: int, step: int) -> Batch:
    """The batch with uniform noise in [-noise, noise] added to its aux states (a regulariser
    against the drafter leaning on exact feature values), drawn from a generator of (seed,
    step) so that a resumed run adds what the killed one would have."""
    if noise == 0:
        return batch
    generator = torch.Generator(batch.aux.device).manual_seed(seed * 1_000_003 + step)
    uniform = torch.rand(
        batch.aux.shape, generator=generator, device=batch.aux.device, dtype=torch.float32
    )
    batch.aux = batch.aux + ((2 * uniform - 1) * noise).to(batch.aux.dtype)
    return batch


def step_refs(
    plan: BatchPlan,
    first_step: int,
    total_steps: int,
    epoch_steps: list[int],
    processes: Processes,
) -> Iterator[tuple[int, int, list[SampleRef]]]:
    """(epoch, position, samples) of this process for every step from first_step on. The
    samples are a function of (seed, epoch): a resumed run gets those the killed one would
    have."""
    epoch, start = 0, 0  # the epoch of `step`, and its first step
    order: list[list[SampleRef]] | None = None
    for step in range(first_step, total_steps):
        while step >= start + epoch_steps[epoch]:
            start += epoch_steps[epoch]
            epoch, order = epoch + 1, None
        if order is None:
            order = plan.epoch_order(epoch)
        position = step - start
        yield epoch, position, order[position * processes.world_size + processes.rank]


def step_batches(
    plan: BatchPlan,
    first_step: int,
    total_steps: int,
    epoch_steps: list[int],
    processes: Processes,
) -> Iterator[tuple[int, int, Batch]]:
    """(epoch, position, batch) of this process for every step from first_step on (step_refs)."""
    for epoch, position, refs in step_refs(plan, first_step, total_steps, epoch_steps, processes):
        layers = plan.aux_layer_ids  # the family's columns of the captured aux
        if plan.packed:
            packed = build_packed_batch(
                refs, plan.shards, plan.max_batch_tokens, layers, plan.sequence
            )
            yield epoch, position, packed
        else:
            yield epoch, position, build_batch(refs, plan.shards, layers, plan.sequence)


def prefetch(items: Iterator, depth: int) -> Iterator:
    """Build the next `depth` items in a thread while the caller computes (reading shards
    overlaps with the drafter's forward and backward on the GPU)."""
    import queue
    import threading

    slots: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def fill() -> None:
        try:
            for item in items:
                slots.put(item)
        except Exception as error:  # noqa: BLE001 (re-raised in the caller's thread)
            slots.put(error)
        slots.put(done)

    threading.Thread(target=fill, daemon=True, name="prefetch").start()
    while (item := slots.get()) is not done:
        if isinstance(item, Exception):
            raise item
        yield item
