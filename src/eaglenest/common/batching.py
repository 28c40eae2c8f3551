"""Batches of samples under a padded-token budget, shared by hidden-state extraction and training."""

from __future__ import annotations

import numpy as np


def pack_batches(lengths: list[int] | np.ndarray, max_batch_tokens: int) -> list[list[int]]:
    """Sample indices in batches, longest first, each under max_batch_tokens padded tokens
    (batch size x its longest sample); a sample longer than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = int(lengths[current[0]]) if current else int(lengths[i])
        if current and (len(current) + 1) * longest > max_batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pooled_batches(
    lengths: list[int] | np.ndarray,
    max_batch_tokens: int,
    pool_batches: int,
    rng: np.random.Generator,
) -> list[list[int]]:
    """Batches of a random composition that waste little padding: the samples in a random order,
    cut into pools of about `pool_batches` batches' worth of tokens, each pool length-sorted into
    batches (`pack_batches`), the batches in a random order. A new `rng` draw gives new batches
    (training draws one per epoch with train.shuffle_pool > 0)."""
    lengths = np.asarray(lengths)
    pools: list[list[int]] = []
    pool: list[int] = []
    tokens = 0
    for i in rng.permutation(len(lengths)).tolist():
        pool.append(i)
        tokens += int(lengths[i])
        if tokens >= pool_batches * max_batch_tokens:
            pools.append(pool)
            pool, tokens = [], 0
    if pool:
        pools.append(pool)
    batches = [
        [pool[i] for i in batch]
        for pool in pools
        for batch in pack_batches(lengths[pool], max_batch_tokens)
    ]
    return [batches[b] for b in rng.permutation(len(batches))]
