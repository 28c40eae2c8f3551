"""The loss shared by the families that draft several tokens in one forward (P-EAGLE in
eaglenest.drafter.p_eagle, DFlash in eaglenest.drafter.dflash): each drafted slot's per-position
loss against the target, weighted by slot, summed, and divided by a count of positions.

The per-position loss is a function (`PositionLoss`): by default `hard_cross_entropy`, the
project's default objective (stages/train/loss.py's `Objective`, where its reasons are given);
training passes `position_losses` with the run's `Objective` to use the others. What a family
weighs and what it divides by are the family's recipe: see `weighted_slot_loss`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (drafter logits [..., D], the target's log-probabilities of the draft tokens [..., D], valid
# [...]) -> each position's loss [...], 0 off `valid`.
PositionLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def hard_cross_entropy(
    logits: torch.Tensor, target_logprobs: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """-log q at the target's argmax over the draft vocabulary, 0 off `valid`."""
    wide = torch.promote_types(logits.dtype, torch.float32)
    log_q = F.log_softmax(logits.to(wide), dim=-1)
    best = target_logprobs.argmax(-1, keepdim=True)
    return torch.where(valid, -log_q.gather(-1, best)[..., 0], 0.0)


@dataclass
class SlotStats:
    """Per drafted slot: its unweighted mean loss, argmax hits and counted positions."""

    loss: list[float]
    correct: list[int]
    counted: list[int]

    @property
    def accuracy(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.correct, self.counted, strict=True)]


def weighted_slot_loss(
    slots: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    weights: Sequence[float],
    denominator: float,
    position_loss: PositionLoss = hard_cross_entropy,
) -> tuple[torch.Tensor, SlotStats]:
    """sum_j weights[j] * (sum of slot j's position losses) / denominator, and the statistics.

    `slots` yields (logits, target log-probabilities, valid) of slot 0, 1, ... (one at a time, so
    a family can build each slot's targets only when it is scored). `denominator` is the
    family's: DFlash divides by the count of trained positions, P-EAGLE by their weighted count
    (each module says why); under DDP, the count over every rank."""
    total: torch.Tensor | None = None
    stats = SlotStats([], [], [])
    for j, (logits, target, valid) in enumerate(slots):
        losses = position_loss(logits, target, valid)
        slot_sum = losses.sum()
        term = weights[j] * slot_sum / max(denominator, 1.0)
        total = term if total is None else total + term
        counted = int(valid.sum())
        with torch.no_grad():
            hits = (logits.argmax(-1) == target.argmax(-1)) & valid
        stats.loss.append(float(slot_sum.detach()) / max(counted, 1))
        stats.correct.append(int(hits.sum()))
        stats.counted.append(counted)
    if total is None:
        raise ValueError("weighted_slot_loss: no slots")
    return total, stats
