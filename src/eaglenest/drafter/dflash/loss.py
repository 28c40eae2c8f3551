"""DFlash's training objective (eaglenest.drafter.dflash.model is the model; its module doc
says how speculators trains it): the anchors of a row's blocks, each slot's weight and target,
and the loss.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from eaglenest.drafter.block_loss import (
    PositionLoss,
    SlotStats,
    hard_cross_entropy,
    weighted_slot_loss,
)
from eaglenest.drafter.dflash.model import GAMMA, MAX_ANCHORS
from eaglenest.drafter.layers import shift_left
from eaglenest.drafter.views import continues

if TYPE_CHECKING:  # annotations only: the batches' module is deep in the import graph
    from eaglenest.drafter.batches import Batch


def select_anchors(
    loss_mask: torch.Tensor,
    block_size: int,
    max_anchors: int = MAX_ANCHORS,
    generator: torch.Generator | None = None,
    segments: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, N] anchor positions per row, ascending, -1 past each row's own (N = the most any row
    has, at most max_anchors; a random subset where a row has more, drawn from `generator`).

    The references' rule (SpecForge's and speculators' DFlash: any answer position): an anchor a
    is a loss-masked position of a sample that a token of the same sample precedes (the context
    is never empty) and whose next token is in the answer of that sample, so its slot 1 trains;
    `block_targets` masks the slots past the answer, the sample or the row. An answer shorter
    than the block trains, and its last token (the end of turn) is slot 1 of the anchor before
    it. (An answer's last position would anchor a block with nothing to learn: left out, so it
    takes none of the max_anchors draws; the loss is the same.) With a view's `positions`, an
    anchor's next row must be its true next position (not across the seam after a sink), and
    so must the anchor be its previous row's: a window's first row holds the token after the
    sink, not its own (eaglenest.drafter.views)."""
    b = loss_mask.shape[0]
    answer = loss_mask.bool()
    eligible = answer & shift_left(answer, 1, False)
    has_context = torch.zeros_like(answer)
    has_context[:, 1:] = True
    if segments is not None:
        eligible = eligible & (shift_left(segments, 1, -2) == segments)
        has_context[:, 1:] = segments[:, 1:] == segments[:, :-1]
    eligible = eligible & has_context
    if positions is not None:
        follows = continues(positions, 1)
        eligible = eligible & follows
        eligible[:, 1:] &= follows[:, :-1]
    rows = []
    for row in range(b):
        found = eligible[row].nonzero()[:, 0]
        if found.numel() > max_anchors:
            pick = torch.randperm(found.numel(), generator=generator)[:max_anchors]
            found = found[pick.to(found.device)].sort().values
        rows.append(found)
    n = max((len(r) for r in rows), default=0)
    anchors = torch.full((b, n), -1, dtype=torch.long, device=loss_mask.device)
    for row, found in enumerate(rows):
        anchors[row, : len(found)] = found
    return anchors


def position_weights(block_size: int, gamma: float = GAMMA) -> list[float]:
    """Slot j's loss weight: 0 for the anchor, exp(-(j - 1) / gamma) for the drafted ones."""
    return [0.0] + [math.exp(-(j - 1) / gamma) for j in range(1, block_size)]


def block_targets(
    batch: Batch, anchors: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's log-probabilities [B, N, bs, D] each slot learns (slot j of anchor a: the
    target's distribution at a + j - 1) and where it is trained [B, N, bs]: j >= 1, the
    anchor exists, the token a + j is in the answer (of the anchor's sample) and the target's
    argmax is a draft token. Every slot past the answer (a padded row's, a packed row's sample's),
    past the row or past a view's seam (its row not the anchor's position + j) is untrained."""
    b, n = anchors.shape
    t, d = batch.input_ids.shape[1], batch.target_logits.shape[-1]
    offsets = torch.arange(block_size, device=anchors.device)
    drafted = (anchors.clamp(min=0)[..., None] + offsets).clamp(max=t - 1)  # [B, N, bs]
    source = (drafted - 1).clamp(min=0)
    flat = source.reshape(b, n * block_size)
    targets = batch.target_logits.gather(1, flat[..., None].expand(-1, -1, d))
    valid = (anchors >= 0)[..., None] & (offsets >= 1)
    valid = valid & (anchors[..., None] + offsets < t)
    valid = valid & batch.loss_mask.gather(1, drafted.reshape(b, -1)).view(b, n, block_size)
    valid = valid & batch.in_draft_vocab.gather(1, flat).view(b, n, block_size)
    if batch.segments is not None:
        sample = batch.segments.gather(1, anchors.clamp(min=0))[..., None]
        valid = valid & (batch.segments.gather(1, drafted.reshape(b, -1)).view(b, n, -1) == sample)
    if batch.positions is not None:
        at = batch.positions.gather(1, anchors.clamp(min=0))[..., None]
        held = batch.positions.gather(1, drafted.reshape(b, -1)).view(b, n, -1)
        valid = valid & (held == at + offsets)
    return targets.view(b, n, block_size, d), valid


def dflash_loss(
    logits: torch.Tensor,
    batch: Batch,
    anchors: torch.Tensor,
    gamma: float = GAMMA,
    position_loss: PositionLoss = hard_cross_entropy,
    denominator: float | None = None,
    draft_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SlotStats]:
    """DFlash's loss over the blocks' logits [B, N, bs, D] (`DFlashDrafter.forward`), the batch's
    target signal filled: sum_j w_j (sum of slot j's losses) / (trained slots), w =
    `position_weights`. Statistics per drafted slot (1 .. bs-1: the K drafts, as EAGLE-3's
    steps). `denominator`: the trained slots over every rank, under DDP. `draft_ids` (the target
    id of each draft id): the logits are over the target's whole vocabulary (the target's head),
    and each slot's target (over the draft vocabulary) is laid onto it, -inf elsewhere, so the
    softmax is the one vLLM samples from and the argmax the one it drafts."""
    size = logits.shape[2]
    targets, valid = block_targets(batch, anchors, size)
    weights = position_weights(size, gamma)
    if denominator is None:
        denominator = int(valid.sum())

    def target_of(slot: torch.Tensor) -> torch.Tensor:
        if draft_ids is None:
            return slot
        wide = slot.new_full((*slot.shape[:-1], logits.shape[-1]), float("-inf"))
        return wide.index_copy_(-1, draft_ids.to(slot.device), slot)

    slots = ((logits[:, :, j], target_of(targets[:, :, j]), valid[:, :, j]) for j in range(1, size))
    return weighted_slot_loss(slots, weights[1:], denominator, position_loss)
