"""The draft vocabulary every drafter family predicts over: one head for EAGLE-3, P-EAGLE and
DFlash (the export files they all write and read are eaglenest.drafter.export_files).

The draft vocabulary (eaglenest.stages.vocab): the LM head predicts `draft_vocab_size` ids, draft
id i being target id i + d2t[i]; t2d marks the target ids the head can predict. A draft
vocabulary that is the whole target vocabulary (`is_full_vocab`) ships no d2t and no t2d: the
head predicts target ids directly, and vLLM creates `draft_id_to_target_id` only when the sizes
differ, refusing a checkpoint that has it (llama_eagle3.py, deepseek_eagle3.py,
qwen3_dflash.py). Training and our own evaluation keep the identity mapping (d2t all 0, t2d all
true) in the model, so both read it as the engine does.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

INTEGER_TENSORS = ("d2t", "t2d")  # the mapping's tensors, exported as integers


class VocabSizes(Protocol):
    vocab_size: int  # the target's
    draft_vocab_size: int


def is_full_vocab(config: VocabSizes) -> bool:
    """The draft vocabulary is the target's: the export has no d2t/t2d (vLLM refuses them)."""
    return config.draft_vocab_size == config.vocab_size


class VocabHead(nn.Module):
    """What every family's drafter has of the draft vocabulary: the d2t/t2d buffers, filled by
    `set_vocab`, and the way back from a draft id to a target id. A drafter calls
    `register_vocab` in its constructor."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def register_vocab(self, config: VocabSizes) -> None:
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embedding (reloaded from the target head)."""
        return {k: v for k, v in self.state_dict().items() if k != "embed_tokens.weight"}
