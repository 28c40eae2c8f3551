"""Length-sorted batches under a token budget, shared by hidden-state extraction and training."""

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
