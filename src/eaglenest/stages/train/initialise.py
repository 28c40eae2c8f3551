"""What a run starts from: the drafter (of any family: `initialised`), built from the target's config and seeded, with the
target's embedding (and LM head rows and final norm, unless train.lm_head_init is random), and
the learning-rate schedule (linear warm-up, then cosine down to min_lr_ratio)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.eagle3.export import check_exportable
from eaglenest.drafter.eagle3.model import Eagle3Drafter

if TYPE_CHECKING:
    from eaglenest.formats.draft_vocab import DraftVocab
    from eaglenest.formats.target_head import TargetHead
    from eaglenest.settings.train import TrainSettings


def drafter_config(
    target_config: Any, head: TargetHead, vocab: DraftVocab, settings: TrainSettings
) -> DrafterConfig:
    """The EAGLE-3 drafter's config: the target's sizes, train.drafter's over them."""
    return DrafterConfig.from_target(
        target_config,
        draft_vocab_size=len(vocab.d2t),
        aux_layer_ids=tuple(head.aux_layer_ids),
        overrides=settings.drafter.overrides(),
    )


def build_drafter(
    target_config: Any, head: TargetHead, vocab: DraftVocab, settings: TrainSettings
) -> Eagle3Drafter:
    config = drafter_config(target_config, head, vocab, settings)
    check_exportable(config)  # before training, not after it
    torch.manual_seed(settings.seed)
    model = initialised(Eagle3Drafter(config), head, vocab, settings)
    model.checkpoint_layer = settings.activation_checkpointing
    return model


DrafterT = TypeVar("DrafterT", bound=torch.nn.Module)


def initialised(
    model: DrafterT, head: TargetHead, vocab: DraftVocab, settings: TrainSettings
) -> DrafterT:
    """A drafter of any family (embed_tokens, lm_head, norm, set_vocab), just built under
    `torch.manual_seed(settings.seed)`, given its starting weights."""
    with torch.no_grad():
        if settings.init_std is not None:
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.normal_(0.0, settings.init_std)
        model.embed_tokens.weight.copy_(head.embed)
        if settings.lm_head_init != "random":
            # Start where the target is: its LM head rows of the draft tokens and its final
            # norm, so the drafter has to learn the target's last hidden state, not a new head.
            model.lm_head.weight.copy_(head.lm_head[vocab.draft_ids])
            if head.final_norm is not None:
                model.norm.weight.copy_(head.final_norm)
    model.lm_head.weight.requires_grad_(settings.lm_head_init != "target_frozen")
    model.set_vocab(vocab.d2t, vocab.t2d)
    return model


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor
