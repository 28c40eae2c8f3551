"""The held-out evaluation of the `train` stage: every family's loss and per-slot accuracy on
the held-out shards, judged where the served drafter drafts (completion positions), with the
data's tokens in every slot."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from eaglenest.capture.reader import ask_ahead
from eaglenest.drafter.batches import BatchPlan, TargetSignal, build_batch
from eaglenest.stages.train.distributed import Processes, all_reduce_sum, autocast
from eaglenest.stages.train.loss import Objective

if TYPE_CHECKING:
    from eaglenest.settings.train import TrainSettings
    from eaglenest.stages.train.families import Recipe


@torch.no_grad()
def evaluate_heldout(
    recipe: Recipe,
    plan: BatchPlan,
    signal: TargetSignal,
    settings: TrainSettings,
    processes: Processes,
) -> dict[str, Any]:
    """Loss and per-slot accuracy on held-out shards (every batch, in a fixed order)."""
    model = recipe.model
    model.eval()
    slots = len(recipe.slot_weights)
    sums = [0.0] * (3 * slots)
    # Judged where the served drafter drafts, whatever positions training counts.
    objective = replace(Objective.of(settings), loss_positions="completion")
    mine = plan.epoch_order(0)[processes.rank :: processes.world_size]
    ask_ahead(plan.shards, mine)
    for refs in mine:
        batch = signal.fill(build_batch(refs, plan.shards, plan.aux_layer_ids).to(processes.device))
        with autocast(processes.device, settings.precision):
            _, stats = recipe.loss(model, batch, objective)
        for i in range(slots):
            sums[3 * i] += stats.loss[i] * stats.counted[i]
            sums[3 * i + 1] += stats.correct[i]
            sums[3 * i + 2] += stats.counted[i]
    sums = all_reduce_sum(sums, processes)
    model.train()
    counted = [round(sums[3 * i + 2]) for i in range(slots)]
    return {
        "loss": recipe.heldout_loss([sums[3 * i] for i in range(slots)], counted),
        "step_loss": [sums[3 * i] / max(counted[i], 1) for i in range(slots)],
        "acc": [sums[3 * i + 1] / max(counted[i], 1) for i in range(slots)],
        "positions": int(counted[0]),
    }
