"""The draft vocabulary every drafter family predicts over, and the checkpoint files every family
writes and reads: one home for what EAGLE-3, P-EAGLE and DFlash share.

The draft vocabulary (eaglenest.stages.vocab): the LM head predicts `draft_vocab_size` ids, draft
id i being target id i + d2t[i]; t2d marks the target ids the head can predict. A draft
vocabulary that is the whole target vocabulary (`is_full_vocab`) ships no d2t and no t2d: the
head predicts target ids directly, and vLLM creates `draft_id_to_target_id` only when the sizes
differ, refusing a checkpoint that has it (llama_eagle3.py, deepseek_eagle3.py,
qwen3_dflash.py). Training and our own evaluation keep the identity mapping (d2t all 0, t2d all
true) in the model, so both read it as the engine does.

The files: `model.safetensors` (the trainable tensors, unprefixed, d2t/t2d as integers) beside
the family's `config.json`; the embedding is the target's, never written (reloaded from the
target head when loading).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from eaglenest.common.io import atomic_path, write_json

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
INTEGER_TENSORS = ("d2t", "t2d")


class ExportError(ValueError):
    """An export disagrees with the run it came from; the message names the file and field."""


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


# ---- the files ---------------------------------------------------------------------------------


def export_tensors(
    model: VocabHead, config: VocabSizes, out_dir: Path, dtype: str
) -> dict[str, torch.Tensor]:
    """The tensors of `model`'s export in `dtype` (d2t/t2d kept as integers), without d2t/t2d
    when the draft vocabulary is the target's: refused unless they hold the identity mapping."""
    state = model.trainable_state_dict()
    if is_full_vocab(config):
        if torch.any(state["d2t"] != 0) or not torch.all(state["t2d"]):
            raise ExportError(
                f"{out_dir}: draft_vocab_size equals vocab_size ({config.vocab_size}) but "
                "d2t is not the identity mapping"
            )
        state = {k: v for k, v in state.items() if k not in INTEGER_TENSORS}
        log.info("draft vocabulary = the target's (%d ids): no d2t/t2d", config.vocab_size)
    return {
        name: (v if name in INTEGER_TENSORS else v.to(DTYPES[dtype])).detach().cpu().contiguous()
        for name, v in state.items()
    }


def write_export(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """model.safetensors (written whole or not at all) and config.json."""
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json(out_dir / "config.json", config)


def read_tensors(drafter_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export's model.safetensors."""
    with safe_open(str(drafter_dir / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)


def load_export_state(
    model: VocabHead,
    config: VocabSizes,
    state: dict[str, torch.Tensor],
    embed: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    """Load an export's tensors into `model`, with the target's embedding and, for a full draft
    vocabulary, the identity mapping the export leaves out; floating tensors in `dtype`."""
    state = {**state, "embed_tokens.weight": embed}
    if is_full_vocab(config) and "d2t" not in state:  # the identity mapping (module doc)
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    model.load_state_dict({k: v if k in INTEGER_TENSORS else v.to(dtype) for k, v in state.items()})


def check_captured_layers(
    drafter_dir: Path, aux_layer_ids: Sequence[int], expect_layer_ids: Sequence[int] | None
) -> None:
    """A drafter reads the aux layers the hidden states were captured at, or is refused."""
    if expect_layer_ids is not None and list(aux_layer_ids) != list(expect_layer_ids):
        raise ExportError(
            f"{drafter_dir / 'config.json'}: eagle_aux_hidden_state_layer_ids "
            f"{list(aux_layer_ids)} but the hidden states were captured at "
            f"{list(expect_layer_ids)}"
        )
