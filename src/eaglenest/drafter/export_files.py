"""The checkpoint files every drafter family writes and reads: `model.safetensors` (the trainable
tensors, unprefixed, the draft vocabulary's d2t/t2d as integers and left out where the draft
vocabulary is the target's: eaglenest.drafter.vocab_head) beside the family's own `config.json`.
The embedding is the target's, never written (reloaded from the target head when loading).

Every family's config.json also carries an `eaglenest` section, the run's record, which vLLM
loads as an unread attribute (transformers' PretrainedConfig keeps unknown keys, and vLLM reads
a draft's config.json through it). Beside each family's own entries it records what the served
check (drafter/served_check.py) compares with what vLLM will serve: `trained_record`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglenest.common.io import atomic_path, write_json
from eaglenest.drafter.vocab_head import INTEGER_TENSORS, VocabHead, VocabSizes, is_full_vocab

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ExportError(ValueError):
    """An export disagrees with the run it came from; the message names the file and field."""


@dataclass(frozen=True)
class TrainedFor:
    """What the training loop knows of a drafter beyond its config (None: not known, as for an
    export made outside a run): `trained_positions`, the largest rotary position a training
    batch held + 1; `served_length`, the target's served length the export was made for."""

    trained_positions: int | None = None
    served_length: int | None = None


def trained_record(
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    sliding_windows: Sequence[int | None],
    trained: TrainedFor | None,
) -> dict[str, Any]:
    """The `eaglenest` entries of what a drafter was trained with: its rotary base and schedule
    (None: the default), the window of each decoder layer (None: full attention), the positions
    it trained on and the served length it was exported for."""
    trained = trained or TrainedFor()
    return {
        "trained_positions": trained.trained_positions,
        "served_length": trained.served_length,
        "rope": {"rope_theta": rope_theta, "rope_scaling": rope_scaling},
        "sliding_window": list(sliding_windows),
    }


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
    """A drafter reads aux layers among those the hidden states were captured at (its family's
    subset, train.aux_layer_ids), in the captured order, or is refused."""
    if expect_layer_ids is None:
        return
    captured = list(expect_layer_ids)
    if [i for i in captured if i in set(aux_layer_ids)] != list(aux_layer_ids):
        raise ExportError(
            f"{drafter_dir / 'config.json'}: eagle_aux_hidden_state_layer_ids "
            f"{list(aux_layer_ids)} but the hidden states were captured at {captured}"
        )
