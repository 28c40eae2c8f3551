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


# A row that packs several samples needs a [T, T] mask of what each position sees (and small
# batches attend through a dense [T, T] block, drafter_attention.DENSE_PACKED_SCORES): only
# batches whose longest sample is at most this long are packed, into rows at most this wide;
# longer ones go one sample a row, memory linear.
PACK_MAX_LENGTH = 2048


def pack_width(longest: int, max_batch_tokens: int) -> int:
    """Width of the packed rows of a batch whose longest sample is `longest`: the budget cut into
    as many equal rows as can each hold that sample, so the budget's remainder widens the rows
    instead of going unused (1024 tokens and a longest sample of 130: 7 rows of 146, not 7 of
    130); at most PACK_MAX_LENGTH wide, never narrower than the longest sample. Wider rows than
    that fill better but cost more than they save: attention grows with the width squared (on
    the demo, rows twice the longest sample made an epoch 8% slower)."""
    if longest > PACK_MAX_LENGTH:
        return longest
    rows = max(1, max_batch_tokens // longest)
    return max(longest, min(max_batch_tokens // rows, PACK_MAX_LENGTH))


def pack_rows(lengths: list[int] | np.ndarray, width: int | None = None) -> list[list[int]]:
    """A batch's samples in rows no wider than `width` (default: its longest sample), first fit
    in decreasing length; one sample a row when the longest is over PACK_MAX_LENGTH."""
    longest = int(max(lengths))
    width = max(width or longest, longest)
    if longest > PACK_MAX_LENGTH:
        return [[i] for i in range(len(lengths))]
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        n = int(lengths[i])
        row = next((r for r, room in enumerate(free) if room >= n), None)
        if row is None:
            rows.append([])
            free.append(width)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= n
    return rows


def packed_rows(lengths: list[int] | np.ndarray, max_batch_tokens: int) -> list[list[int]]:
    """The rows a packed batch of these samples trains in (`pack_rows` at `pack_width`)."""
    return pack_rows(lengths, pack_width(int(max(lengths)), max_batch_tokens))


# Samples longer than PACK_MAX_LENGTH go one a row, so a batch of them is padded to its longest:
# drawn at random they would waste half the budget on reasoning-length data (bench/batching.py).
# They are batched from length-sorted pools of this many batches' worth of tokens instead: new
# batches every epoch, little padding.
LONG_POOL_BATCHES = 16


def packed_batches(
    lengths: list[int] | np.ndarray, max_batch_tokens: int, rng: np.random.Generator
) -> list[list[int]]:
    """New batches for each `rng` draw (training draws one per epoch): samples up to
    PACK_MAX_LENGTH in a random order, lengths mixed, each batch as many as fit when packed
    (`packed_rows`: rows x their width <= max_batch_tokens); longer samples one a row, in
    `pooled_batches` of LONG_POOL_BATCHES; the two kinds of batch in a random order. A sample
    longer than the budget goes alone."""
    lengths = np.asarray(lengths)
    short = np.flatnonzero(lengths <= PACK_MAX_LENGTH)
    long = np.flatnonzero(lengths > PACK_MAX_LENGTH)
    batches = [short[b].tolist() for b in _random_packed(lengths[short], max_batch_tokens, rng)]
    if len(long) == 0:
        return batches
    pools = pooled_batches(lengths[long], max_batch_tokens, LONG_POOL_BATCHES, rng)
    batches += [long[b].tolist() for b in pools]
    return [batches[i] for i in rng.permutation(len(batches))]


def _random_packed(
    lengths: np.ndarray, max_batch_tokens: int, rng: np.random.Generator
) -> list[list[int]]:
    """The samples in a random order, cut into batches as many as fit when packed."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in rng.permutation(len(lengths)).tolist():
        trial = [*current, i]
        if current and padded_tokens(lengths[trial], max_batch_tokens) > max_batch_tokens:
            batches.append(current)
            trial = [i]
        current = trial
    if current:
        batches.append(current)
    return batches


def padded_tokens(lengths: np.ndarray, max_batch_tokens: int) -> int:
    """Tokens a packed batch of these samples computes, padding included (rows x width)."""
    width = pack_width(int(lengths.max()), max_batch_tokens)
    return len(pack_rows(lengths, width)) * width
