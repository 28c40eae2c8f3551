"""The draft vocabulary, `vocab/draft_vocab.safetensors`: d2t, t2d and the token counts, as
training and evaluation read it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # [D] int64
    t2d: torch.Tensor  # [V] bool

    @classmethod
    def load(cls, path: str | Path) -> DraftVocab:
        with safe_open(str(path), framework="pt") as f:
            return cls(d2t=f.get_tensor("d2t").long(), t2d=f.get_tensor("t2d").bool())

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft id."""
        return torch.arange(len(self.d2t)) + self.d2t

    @property
    def target_to_draft(self) -> torch.Tensor:
        """Draft id of each target id (-1 outside the draft vocab)."""
        index = torch.full((len(self.t2d),), -1, dtype=torch.long)
        index[self.draft_ids] = torch.arange(len(self.d2t))
        return index
