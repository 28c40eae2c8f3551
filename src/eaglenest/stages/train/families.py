"""The drafter families a run trains from the same shards (`train.families`): per family, the
model it builds, its loss on a batch and its export. The training loop (train.py) calls this
table and nothing else of a family, so batches, checkpoints, resume, metrics and the held-out
loss are one code path for all of them.

- eagle3: eaglenest.drafter.eagle3's drafter, training-time test (`ttt_loss`), drafter/.
- p_eagle: eaglenest.drafter.p_eagle's, its depths in one forward (`parallel_loss`),
  drafter_p_eagle/.
- dflash: eaglenest.drafter.dflash's, blocks at anchors in the answer (`select_anchors`,
  `dflash_loss`), drafter_dflash/; by default with the target's LM head, frozen, over the whole
  vocabulary (train.dflash.head target: `target_vocab`), else a trained draft-vocabulary head.

`RECIPES` holds each family's builder (the families are settings/families.py's).

Each family's loss weighs its drafted slots (TTT steps, depths, block slots) its own way; the
per-position loss is the run's `Objective`. Under DDP a family's loss is rescaled so that the
step's gradient is that of the mean over every rank's positions, as EAGLE-3's (`over_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eaglenest.drafter.block_loss import SlotStats
from eaglenest.drafter.dflash.export import export_dflash
from eaglenest.drafter.dflash.loss import dflash_loss, select_anchors
from eaglenest.drafter.dflash.loss import position_weights as dflash_slot_weights
from eaglenest.drafter.dflash.model import (
    DFlashConfig,
    DFlashDrafter,
    served_positions,
    target_rope_scaling,
)
from eaglenest.drafter.eagle3.export import export_drafter
from eaglenest.drafter.eagle3.model import ttt_forward
from eaglenest.drafter.export_files import TrainedFor
from eaglenest.drafter.layers import shift_left
from eaglenest.drafter.p_eagle.export import check_p_eagle_exportable, export_p_eagle
from eaglenest.drafter.p_eagle.loss import cod_depth_weights, parallel_loss
from eaglenest.drafter.p_eagle.model import PEagleDrafter
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.settings.families import DRAFTER_VARIANTS, family_layer_ids
from eaglenest.settings.train import FamilySettings, TrainSettings
from eaglenest.stages.train.distributed import Processes, all_reduce_sum, global_counts
from eaglenest.stages.train.initialise import build_drafter, drafter_config, initialised
from eaglenest.stages.train.loss import Objective, StepStats, position_losses, ttt_loss
from eaglenest.target_model.loading import text_config

if TYPE_CHECKING:
    from eaglenest.drafter.batches import Batch
    from eaglenest.formats.target_head import TargetHead


class Recipe:
    """What the loop asks of a family: `model`, `loss` of a batch, `export`, and how the
    held-out slots' losses add up (`heldout_loss`, weighed as the training loss)."""

    name: str
    model: nn.Module
    slot_weights: list[float]  # each drafted slot's weight in the loss
    served_length: int | None = None  # the target's positions (`build_recipe`), for the export

    def __init__(self, model: nn.Module, settings: TrainSettings, family: FamilySettings):
        self.model, self.settings, self.family = model, settings, family

    def loss(
        self,
        model: nn.Module,
        batch: Batch,
        objective: Objective,
        processes: Processes | None = None,
        step: int | None = None,
    ) -> tuple[torch.Tensor, StepStats]:
        """The loss of a batch whose target signal is filled, through `model` (the drafter or its
        DDP wrapper), and this process's statistics; `step` None: a held-out batch."""
        raise NotImplementedError

    def heldout_loss(self, loss_sums: list[float], counts: list[int]) -> float:
        """The held-out loss from each slot's summed position losses and count."""
        weights = self.slot_weights
        return sum(w * s for w, s in zip(weights, loss_sums, strict=True)) / max(
            sum(w * n for w, n in zip(weights, counts, strict=True)), 1
        )

    def export(self, out_dir: Path, trained: TrainedFor | None = None) -> None:
        """config.json + model.safetensors, with what the loop recorded (`trained`)."""
        raise NotImplementedError

    def description(self) -> dict[str, Any]:
        """The drafter's config and the family's own settings (the report; what a checkpoint
        is valid for)."""
        return self.model.config.to_dict()


class Eagle3(Recipe):
    name = "eagle3"

    def __init__(self, model: nn.Module, settings: TrainSettings, family: FamilySettings):
        super().__init__(model, settings, family)
        self.slot_weights = [settings.step_weight**i for i in range(settings.ttt_steps)]

    def loss(self, model, batch, objective, processes=None, step=None):
        settings = self.settings
        logits = ttt_forward(
            model,
            batch.aux,
            batch.input_ids,
            settings.ttt_steps,
            # Held out: the data's tokens in every step, whatever training fed, the same
            # yardstick for every recipe (serving accepts a draft only where it equals the data's).
            own_tokens=step is not None and settings.ttt_inputs == "drafter",
            segments=batch.segments,
            positions=batch.positions,
        )
        return ttt_loss(logits, batch, settings.step_weight, processes, objective)

    def heldout_loss(self, loss_sums, counts):
        # Weighted over the TTT steps like the training loss, so the two curves compare.
        steps = zip(self.slot_weights, loss_sums, counts, strict=True)
        return sum(w * s / max(n, 1) for w, s, n in steps)

    def export(self, out_dir, trained=None):
        export_drafter(self.model, out_dir, dtype=self.settings.export_dtype, trained=trained)


class PEagle(Recipe):
    name = "p_eagle"

    def __init__(self, model: nn.Module, settings: TrainSettings, family: FamilySettings):
        super().__init__(model, settings, family)
        self.depths = family.p_eagle.depths
        self.slot_weights = cod_depth_weights(self.depths)

    def loss(self, model, batch, objective, processes=None, step=None):
        counted = counted_positions(batch, objective)
        logits = model(
            batch.aux, batch.input_ids, self.depths, False, batch.segments, batch.positions
        )
        loss, slots = parallel_loss(
            logits, counted, self.slot_weights, objective_loss(objective), None
        )
        local = sum(w * n for w, n in zip(self.slot_weights, slots.counted, strict=True))
        return over_ranks(loss, local, processes), step_stats(slots, counted, processes)

    def export(self, out_dir, trained=None):
        dtype = self.settings.export_dtype
        export_p_eagle(self.model, out_dir, self.depths, dtype=dtype, trained=trained)

    def description(self):
        own = {
            "mask_token_id": self.model.mask_token_id,
            "depths": self.depths,
            "num_hidden_layers": self.model.num_hidden_layers,
            "train_mask_embedding": self.model.train_mask_embedding,
        }
        return {**super().description(), **own}


class DFlash(Recipe):
    name = "dflash"

    def __init__(
        self,
        model: nn.Module,
        settings: TrainSettings,
        family: FamilySettings,
        draft_ids: torch.Tensor | None = None,
    ):
        super().__init__(model, settings, family)
        self.own = family.dflash
        # With the target's head: the target id of each draft id, where the batch's target
        # signal (over the draft vocabulary) is laid onto the logits (`dflash_loss`).
        self.draft_ids = draft_ids
        # Slot 0 (the anchor, the bonus token when served) is never trained: the K drafts.
        self.slot_weights = dflash_slot_weights(self.own.block_size, self.own.gamma)[1:]

    def loss(self, model, batch, objective, processes=None, step=None):
        counted = counted_positions(batch, objective)
        # A function of (seed, step), so a resumed run draws the anchors the killed one would
        # have; held-out batches always draw the same ones (a step no run reaches).
        seed = self.settings.seed * 1_000_003 + (1_000_002 if step is None else step)
        generator = torch.Generator().manual_seed(seed)
        anchors = select_anchors(
            counted.loss_mask.cpu(),
            self.own.block_size,
            self.own.max_anchors,
            generator,
            None if batch.segments is None else batch.segments.cpu(),
            None if batch.positions is None else batch.positions.cpu(),
        ).to(batch.input_ids.device)
        logits = model(batch.aux, batch.input_ids, anchors, batch.segments, batch.positions)
        loss, slots = dflash_loss(
            logits,
            counted,
            anchors,
            self.own.gamma,
            objective_loss(objective),
            None,
            None if self.draft_ids is None else self.draft_ids.to(logits.device),
        )
        return over_ranks(loss, sum(slots.counted), processes), step_stats(
            slots, counted, processes
        )

    def description(self):
        own = {"max_anchors": self.own.max_anchors, "gamma": self.own.gamma}
        return {**super().description(), **own}  # head and block: the config's

    def heldout_loss(self, loss_sums, counts):
        # dflash_loss divides by the count of trained slots, unweighted.
        weighted = sum(w * s for w, s in zip(self.slot_weights, loss_sums, strict=True))
        return weighted / max(sum(counts), 1)

    def export(self, out_dir, trained=None):
        dtype, gamma = self.settings.export_dtype, self.own.gamma
        export_dflash(self.model, out_dir, dtype=dtype, gamma=gamma, trained=trained)


# ---- the loss pieces the parallel families share --------------------------------------------


def counted_positions(batch: Batch, objective: Objective) -> Batch:
    """The batch whose loss_mask is the positions the objective counts (train.loss_positions
    all: every token of each sample, as EAGLE-3's `ttt_loss` counts them)."""
    if objective.loss_positions == "completion":
        return batch
    return replace(batch, loss_mask=batch.token_mask)


def objective_loss(objective: Objective):
    """The run's per-position loss (stages/train/loss.py) in block_loss's signature."""

    def loss(logits, target_logprobs, valid):
        return position_losses(logits, target_logprobs, valid, objective)

    return loss


def over_ranks(loss: torch.Tensor, local: float, processes: Processes | None) -> torch.Tensor:
    """A loss divided by this rank's count `local`, made the rank's share of the mean over every
    rank's positions, times the world size (DDP averages gradients), as `ttt_loss` does."""
    if processes is None or processes.world_size == 1:
        return loss
    (total,) = all_reduce_sum([float(local)], processes)
    return loss * (local / max(total, 1.0)) * processes.world_size


def step_stats(slots: SlotStats, counted: Batch, processes: Processes | None) -> StepStats:
    """The loop's statistics of a parallel family's step: each slot's loss as this rank's share
    of the mean over the ranks (they add up under `global_step`), and the answer's positions
    whose target argmax is outside the draft vocabulary."""
    counts = slots.counted
    several = processes is not None and processes.world_size > 1
    totals = global_counts(counts, processes) if several else counts
    losses = [loss * n / max(t, 1) for loss, n, t in zip(slots.loss, counts, totals, strict=True)]
    skipped = shift_left(counted.loss_mask, 1, False) & ~shift_left(
        counted.in_draft_vocab, 1, False
    )
    return StepStats(losses, list(slots.correct), list(counts), int(skipped.sum()))


# ---- building a family's drafter -------------------------------------------------------------


def mask_token_id(family: FamilySettings, vocab_size: int) -> int:
    """train.mask_token_id, else the first embedding row past the tokenizer's vocabulary (an id
    no text encodes to: Qwen3's 151669, as z-lab's DFlash drafters take), else the tokenizer's
    pad token where it is not its end of sequence (the demo's tokenizer fills its embedding)."""
    if family.mask_token_id is not None:
        return family.mask_token_id
    from eaglenest.target_model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(family.target)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    pad = tokenizer.pad_token_id
    if pad is not None and pad != tokenizer.eos_token_id:
        return int(pad)
    raise ValueError(
        f"train.mask_token_id: the tokenizer fills the target's {vocab_size} embedding rows and "
        "its pad token is none or its end-of-sequence token; set a token id the answers do not "
        "use (a reserved token of the tokenizer)"
    )


def build_eagle3(
    target_config: Any,
    head: TargetHead,
    vocab: DraftVocab,
    settings: TrainSettings,
    family: FamilySettings,
) -> Recipe:
    return Eagle3(build_drafter(target_config, head, vocab, settings), settings, family)


def build_p_eagle(
    target_config: Any,
    head: TargetHead,
    vocab: DraftVocab,
    settings: TrainSettings,
    family: FamilySettings,
) -> Recipe:
    config = drafter_config(target_config, head, vocab, settings)
    mask = mask_token_id(family, config.vocab_size)
    check_p_eagle_exportable(config)
    torch.manual_seed(settings.seed)
    own = family.p_eagle
    drafter = PEagleDrafter(config, mask, own.num_hidden_layers, own.train_mask_embedding)
    model = initialised(drafter, head, vocab, settings)
    model.checkpoint_layer = settings.activation_checkpointing
    return PEagle(model, settings, family)


def build_dflash(
    target_config: Any,
    head: TargetHead,
    vocab: DraftVocab,
    settings: TrainSettings,
    family: FamilySettings,
) -> Recipe:
    config = drafter_config(target_config, head, vocab, settings)
    mask = mask_token_id(family, config.vocab_size)
    # DFlash is Qwen3 layers of its own: the EAGLE-3 variants are not its (they would be refused).
    # Its positions cover the target's: vLLM raises an EAGLE-3 draft's, never a DFlash draft's.
    positions = max(config.max_position_embeddings, served_positions(target_config))
    plain = replace(
        config,
        max_position_embeddings=positions,
        **{name: False for name in DRAFTER_VARIANTS},
    )
    own = family.dflash
    dflash = DFlashConfig.from_drafter(
        plain,
        num_hidden_layers=own.num_hidden_layers,
        block_size=own.block_size,
        mask_token_id=mask,
        rope_scaling=target_rope_scaling(target_config),
        head=own.head,
    )
    torch.manual_seed(settings.seed)
    if not dflash.target_head:
        return DFlash(initialised(DFlashDrafter(dflash), head, vocab, settings), settings, family)
    # The references' layout: every target row of the LM head (and its final norm, as the norm
    # starts), frozen; the identity vocabulary, so drafts are target ids.
    frozen = replace(settings, lm_head_init="target_frozen")
    model = initialised(DFlashDrafter(dflash), head, target_vocab(dflash.vocab_size), frozen)
    return DFlash(model, settings, family, vocab.draft_ids)


def target_vocab(vocab_size: int) -> DraftVocab:
    """The draft vocabulary that is the target's whole one (draft id = target id)."""
    return DraftVocab(
        d2t=torch.zeros(vocab_size, dtype=torch.long),
        t2d=torch.ones(vocab_size, dtype=torch.bool),
    )


# family -> its drafter, built in its recipe (settings/families.py lists the families)
RECIPES: dict[str, Callable[..., Recipe]] = {
    "eagle3": build_eagle3,
    "p_eagle": build_p_eagle,
    "dflash": build_dflash,
}


def build_recipe(
    head: TargetHead, vocab: DraftVocab, settings: TrainSettings, family: FamilySettings
) -> Recipe:
    """The family's drafter, sized by the target's config (train.drafter's sizes over it),
    seeded and initialised as EAGLE-3's (`initialised`), in its recipe (RECIPES). A drafter
    vLLM 0.32 could not serve as trained is refused before training."""
    from transformers import AutoConfig

    from eaglenest.target_model.files import resolve_target_dir

    target = settings.target
    target_config = AutoConfig.from_pretrained(
        str(resolve_target_dir(target.path)), trust_remote_code=target.trust_remote_code
    )
    recipe = RECIPES[family.name](
        target_config, family_head(head, family, target_config), vocab, settings, family
    )
    recipe.served_length = served_positions(target_config) or None
    return recipe


def family_head(head: TargetHead, family: FamilySettings, target_config: Any) -> TargetHead:
    """The target head as the family's drafter sees it: its aux layers those it reads of the
    captured ones (train.aux_layer_ids.<family>, else its default: settings/families.py
    `family_layer_ids`), so that every recipe's drafter config holds its own layers."""
    n_layers = text_config(target_config).num_hidden_layers
    captured = head.aux_layer_ids
    layers = family_layer_ids(family.name, family.aux_layer_ids, captured, n_layers)
    return replace(head, aux_layer_ids=list(layers))
