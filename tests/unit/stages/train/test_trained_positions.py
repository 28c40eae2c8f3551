"""The positions a drafter trained on (stages/train/feed.py `trained_positions`, recorded in its
export's `eaglenest.trained_positions`): the longest sample of the batches the steps took, over
every rank, from the plan the loop reads, so a cut epoch counts only its steps' batches."""

from __future__ import annotations

from eaglenest.drafter.batches import SampleRef
from eaglenest.stages.train.feed import trained_positions


class Plan:
    """Epoch e's batches: one a length of `lengths[e]`, in that order."""

    def __init__(self, lengths: list[list[int]]):
        self.lengths = lengths

    def epoch_order(self, epoch: int) -> list[list[SampleRef]]:
        return [[SampleRef(0, i, 1), SampleRef(0, i, n)] for i, n in enumerate(self.lengths[epoch])]


def test_the_longest_sample_of_the_steps_taken_over_every_rank():
    plan = Plan([[10, 20, 30, 40], [50, 5, 5, 5]])
    assert trained_positions(plan, 4, [4, 4], world_size=1) == 40
    assert trained_positions(plan, 2, [4, 4], world_size=1) == 20  # the steps taken only
    assert trained_positions(plan, 5, [4, 4], world_size=1) == 50  # into the next epoch
    # Two ranks: a step takes two batches, an epoch half as many steps.
    assert trained_positions(plan, 1, [2, 2], world_size=2) == 20
    assert trained_positions(plan, 2, [2, 2], world_size=2) == 40
