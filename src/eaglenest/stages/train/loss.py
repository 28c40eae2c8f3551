"""The training objective: the per-position loss between the drafter's distribution over the
draft vocabulary and the target's (`Objective`, `position_losses`), weighted over the TTT steps
(`ttt_loss`), and the step's statistics.

Loss of TTT step i (weight `step_weight`**i): the mean over the loss-masked positions whose target
argmax is a draft token (over all processes under DDP) of a per-position loss. A target counts
only where it is the true position i + 1 after its query's (the same sample, and no seam of a
view between them: eaglenest.drafter.views). Masked positions
whose target argmax lies outside the draft vocabulary are skipped and counted
(`skipped_outside_vocab`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from eaglenest.drafter.layers import shift_left
from eaglenest.drafter.views import continues
from eaglenest.stages.train.distributed import Processes, all_reduce_sum, global_counts

if TYPE_CHECKING:
    from eaglenest.drafter.batches import Batch
    from eaglenest.settings.train import TrainSettings


@dataclass
class StepStats:
    loss: list[float]
    correct: list[int]
    counted: list[int]
    skipped_outside_vocab: int

    @property
    def accuracy(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.correct, self.counted, strict=True)]


@dataclass(frozen=True)
class Objective:
    """The per-position loss (`train.loss`, `train.target_outside_vocab`).

    loss:
    - cross_entropy: -sum_d p_d log q_d, p the target's distribution over the draft vocabulary
      (EAGLE-3's soft labels);
    - forward_kl: KL(p || q) = sum_d p_d (log p_d - log q_d): cross_entropy less the target's
      entropy, so the same gradient; its value is 0 when the drafter matches the target;
    - hard_cross_entropy: -log q at the target's argmax (greedy labels, no soft targets), the
      default: vLLM drafts the drafter's argmax and verifies it with no draft probability
      (v1/sample/rejection_sampler.py: draft_prob = 1, accepted while the target's probability
      of the draft token >= a uniform draw), so at any temperature the draft that is accepted
      most is the target's argmax; soft labels spend the drafter's capacity on the rest of the
      distribution (experiments/recipe.py: +6 % acceptance at K=3, +12 % at K=7 on the demo).
    target_outside_vocab (what p is, where the target puts mass on tokens outside the draft
    vocabulary):
    - renormalise: p = the target's probabilities of the draft tokens divided by their sum;
    - ignore: p = the target's full-vocabulary probabilities of the draft tokens, so p sums to
      the draft vocabulary's share and the mass outside pulls nothing (a position where the
      target is unsure between a draft token and an outside one weighs less).
    loss_positions (which positions count):
    - completion: those whose next token is a completion token, where the served drafter drafts;
    - all: every position of each sample, the prompt's too: there the target's prediction of the
      prompt's next token (not the prompt token itself) is the label, more supervision from the
      same hidden states.
    """

    loss: str = "hard_cross_entropy"
    target_outside_vocab: str = "renormalise"
    loss_positions: str = "completion"

    LOSSES = ("cross_entropy", "forward_kl", "hard_cross_entropy")
    OUTSIDE_VOCAB = ("renormalise", "ignore")
    POSITIONS = ("completion", "all")

    def __post_init__(self) -> None:
        if self.loss not in self.LOSSES:
            raise ValueError(f"train.loss {self.loss!r}: one of {', '.join(self.LOSSES)}")
        if self.target_outside_vocab not in self.OUTSIDE_VOCAB:
            raise ValueError(
                f"train.target_outside_vocab {self.target_outside_vocab!r}: one of "
                + ", ".join(self.OUTSIDE_VOCAB)
            )
        if self.loss_positions not in self.POSITIONS:
            raise ValueError(
                f"train.loss_positions {self.loss_positions!r}: one of {', '.join(self.POSITIONS)}"
            )

    @classmethod
    def of(cls, settings: TrainSettings) -> Objective:
        return cls(settings.loss, settings.target_outside_vocab, settings.loss_positions)


def position_losses(
    logits: torch.Tensor, target_logprobs: torch.Tensor, valid: torch.Tensor, objective: Objective
) -> torch.Tensor:
    """Each position's loss [B, T] (0 off `valid`): drafter logits [B, T, D] against the target's
    full-vocabulary log-probabilities of the draft tokens [B, T, D] (`Batch.target_logits`)."""
    wide = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits: float32 losses
    log_q = F.log_softmax(logits.to(wide), dim=-1)
    if objective.loss == "hard_cross_entropy":
        best = target_logprobs.argmax(-1, keepdim=True)
        return torch.where(valid, -log_q.gather(-1, best)[..., 0], 0.0)
    target = target_logprobs.to(wide)
    p = target.softmax(-1) if objective.target_outside_vocab == "renormalise" else target.exp()
    # Zero the target off the valid positions before it meets the log-probs: a row of -inf
    # (top-k with no draft token) would put NaN into the gradient even behind a mask.
    p = torch.where(valid[..., None], p, 0.0).nan_to_num(0.0)
    loss = -(p * log_q).sum(-1)
    if objective.loss == "forward_kl":
        loss = loss + torch.xlogy(p, p).sum(-1)
    return loss


def ttt_loss(
    step_logits: list[torch.Tensor],
    batch: Batch,
    step_weight: float,
    processes: Processes | None = None,
    objective: Objective = Objective(),
) -> tuple[torch.Tensor, StepStats]:
    """Weighted TTT loss over the steps' logits [B, T, D], and this process's statistics.

    With `processes` of several ranks (DDP), step i's sum is divided by the count of valid
    positions over all ranks, and the loss is multiplied by the world size: DDP averages the
    gradients, so their average is the gradient of the mean over every rank's positions.
    `stats.loss[i]` is then this rank's share of that mean (the shares add up to it)."""
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    stats = StepStats([], [], [], 0)
    # Step i at position t predicts what the target predicts at position t + 1 + i.
    counted = batch.loss_mask if objective.loss_positions == "completion" else batch.token_mask
    masked = [shift_left(counted, 1 + i, False) for i in range(len(step_logits))]
    if batch.segments is not None:  # packed rows: a target in the next sample is no target
        masked = [
            m & (shift_left(batch.segments, 1 + i, -1) == batch.segments)
            for i, m in enumerate(masked)
        ]
    if batch.positions is not None:  # a view's seam: only the true next positions are targets
        masked = [m & continues(batch.positions, 1 + i) for i, m in enumerate(masked)]
    valid = [m & shift_left(batch.in_draft_vocab, 1 + i, False) for i, m in enumerate(masked)]
    counts = [int(v.sum()) for v in valid]
    world_size = processes.world_size if processes else 1
    denominators = global_counts(counts, processes) if world_size > 1 else counts
    for i, logits in enumerate(step_logits):
        target = shift_left(batch.target_logits, 1 + i)
        loss_i = position_losses(logits, target, valid[i], objective).sum()
        loss_i = loss_i / max(denominators[i], 1)
        total = total + (step_weight**i) * loss_i
        with torch.no_grad():
            hits = (logits.argmax(-1) == target.argmax(-1)) & valid[i]
        stats.loss.append(float(loss_i.detach()))
        stats.correct.append(int(hits.sum()))
        stats.counted.append(counts[i])
    stats.skipped_outside_vocab = int((masked[0] & ~valid[0]).sum())
    if world_size > 1:
        total = total * world_size
    return total, stats


def global_step(
    loss: torch.Tensor, stats: StepStats, processes: Processes
) -> tuple[float, StepStats]:
    """The step's loss (the mean over every process's positions) and statistics summed over
    the processes; in one process, `loss` and `stats` as they are."""
    if processes.world_size == 1:
        return float(loss.detach()), stats
    steps = len(stats.loss)
    values = all_reduce_sum(
        [
            float(loss.detach()) / processes.world_size,  # ttt_loss scaled it up for DDP
            *stats.loss,
            *stats.correct,
            *stats.counted,
            stats.skipped_outside_vocab,
        ],
        processes,
    )
    counts = [round(x) for x in values[1 + steps :]]
    total = StepStats(values[1 : 1 + steps], counts[:steps], counts[steps:-1], counts[-1])
    return values[0], total
