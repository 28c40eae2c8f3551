"""P-EAGLE's training objective (eaglenest.drafter.p_eagle.model is the model).

Objective: depth d at position t learns the target's distribution at t + 1 + d (its next
token, x_t+2+d) where position t + 1 + d is in the answer (loss_mask), the target's argmax is a
draft token, (packed rows) t + 1 + d is in t's sample and (a view's seam) is t's true position
1 + d after it: EAGLE-3's step d's positions
(stages/train/loss.py). speculators trains depth d on a random share max(0.7^d, 0.2) of the
positions (COD sampling, to save memory) and averages the loss over all sampled positions; here
every position is computed and depth d weighted by that share (`cod_depth_weights`): about the
same loss in expectation, without its sampling noise. Speculators trains the embedding for
P-EAGLE; here the mask token's row alone is trained (train.p_eagle.train_mask_embedding, the
model's doc), the rest of the embedding stays the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from eaglenest.drafter.block_loss import (
    PositionLoss,
    SlotStats,
    hard_cross_entropy,
    weighted_slot_loss,
)
from eaglenest.drafter.layers import shift_left
from eaglenest.drafter.views import continues

if TYPE_CHECKING:  # annotations only: the batches' module is deep in the import graph
    from eaglenest.drafter.batches import Batch

# speculators' COD sampling (models/peagle/core.py, get_trainer_kwargs): depth d keeps a share
# max(COD_RATIO**d, COD_RATIO_MIN) of the positions.
COD_RATIO = 0.7
COD_RATIO_MIN = 0.2


def cod_depth_weights(
    depths: int, ratio: float = COD_RATIO, floor: float = COD_RATIO_MIN
) -> list[float]:
    """The expected share of positions speculators' COD sampling trains at each depth."""
    return [1.0] + [max(ratio**d, floor) for d in range(1, depths)]


def depth_valid(batch: Batch, depths: int) -> list[torch.Tensor]:
    """[B, T] bool per depth d: position t's depth-d draft is trained (module doc)."""
    valid = []
    for d in range(depths):
        v = shift_left(batch.loss_mask, 1 + d, False) & shift_left(
            batch.in_draft_vocab, 1 + d, False
        )
        if batch.segments is not None:
            v = v & (shift_left(batch.segments, 1 + d, -1) == batch.segments)
        if batch.positions is not None:  # not across a view's seam (drafter/views.py)
            v = v & continues(batch.positions, 1 + d)
        valid.append(v)
    return valid


def parallel_loss(
    depth_logits: list[torch.Tensor],
    batch: Batch,
    depth_weights: Sequence[float] | None = None,
    position_loss: PositionLoss = hard_cross_entropy,
    denominator: float | None = None,
) -> tuple[torch.Tensor, SlotStats]:
    """P-EAGLE's loss over the depths' logits [B, T, D] (`PEagleDrafter.forward`), the batch's
    target signal filled: sum_d w_d (sum of depth d's losses) / sum_d w_d n_d, n_d the depth's
    trained positions, w_d `cod_depth_weights` unless given. `denominator`: sum_d w_d n_d over
    every rank, under DDP."""
    weights = list(depth_weights or cod_depth_weights(len(depth_logits)))
    if len(weights) != len(depth_logits):
        raise ValueError(f"{len(depth_logits)} depths but {len(weights)} depth weights")
    valid = depth_valid(batch, len(depth_logits))
    if denominator is None:
        denominator = sum(w * int(v.sum()) for w, v in zip(weights, valid, strict=True))
    slots = (
        (logits, shift_left(batch.target_logits, 1 + d), valid[d])
        for d, logits in enumerate(depth_logits)
    )
    return weighted_slot_loss(slots, weights, denominator, position_loss)
