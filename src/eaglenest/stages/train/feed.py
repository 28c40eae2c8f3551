"""What each training step trains on: the batches of this process for every step from any step
on (a function of the seed and the epoch, so a resumed run gets the batches the killed one would
have), built ahead in a thread, with the aux noise of train.aux_noise."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from eaglenest.drafter.batches import Batch, BatchPlan, SampleRef, build_batch, build_packed_batch
from eaglenest.stages.train.distributed import Processes


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


def trained_positions(
    plan: BatchPlan, total_steps: int, epoch_steps: list[int], world_size: int
) -> int:
    """The largest rotary position a training batch of steps 0..total_steps held, + 1, over
    every rank: positions restart at each sample (packed rows too), so the longest sample
    trained. From the plan, which is the data's order: a resumed run counts what the killed
    one trained."""
    longest, left = 0, total_steps
    for epoch, steps in enumerate(epoch_steps):
        if left <= 0:
            break
        taken = min(steps, left)
        for refs in plan.epoch_order(epoch)[: taken * world_size]:
            longest = max(longest, *(ref.length for ref in refs))
        left -= taken
    return longest


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
            packed = build_packed_batch(refs, plan.shards, plan.max_batch_tokens, layers)
            yield epoch, position, packed
        else:
            yield epoch, position, build_batch(refs, plan.shards, layers)


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
