"""The target head, `hidden/target_head.safetensors`: the target's embedding, final norm and LM
head, read by tensor name from the checkpoint's safetensors files (eaglenest.target_model.checkpoint,
never loading the model), and read back for training and evaluation."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from eaglenest.common.io import atomic_path, library_versions
from eaglenest.formats.hidden_shard import FORMAT
from eaglenest.target_model.checkpoint import TargetHeadError, checkpoint_head_tensors
from eaglenest.target_model.files import resolve_target_dir
from eaglenest.target_model.loading import (
    captured_layer_ids,
    load_text_config,
    target_config_hash,
)

if TYPE_CHECKING:
    from eaglenest.settings.hidden_states import TargetHeadSettings

log = logging.getLogger(__name__)

__all__ = ["TargetHead", "TargetHeadError", "save_target_head"]


def save_target_head(out: str | Path, settings: TargetHeadSettings) -> dict[str, str]:
    """Input embedding, LM head (unless tied to the embedding) and final norm of the target, read
    from its checkpoint files without loading the model (Kimi-K2.5 is hundreds of GB)."""
    from safetensors.torch import save_file

    target_path, trust_remote_code = settings.target.path, settings.target.trust_remote_code
    target_dir = resolve_target_dir(target_path)
    config = load_text_config(target_path, trust_remote_code)  # Kimi-K2.5: its text_config
    tensors, tied = checkpoint_head_tensors(
        target_dir, bool(getattr(config, "tie_word_embeddings", False))
    )
    n_layers = config.num_hidden_layers
    layer_ids = captured_layer_ids(settings.aux_layer_ids, settings.layer_rules, n_layers)
    metadata = {
        "format": FORMAT,
        "target_path": str(target_path),
        "target_config_sha256": target_config_hash(target_dir),
        "aux_layer_ids": json.dumps(list(layer_ids)),
        "hidden_size": str(config.hidden_size),
        "vocab_size": str(config.vocab_size),
        "tied_word_embeddings": json.dumps(tied),
        "rms_norm_eps": str(getattr(config, "rms_norm_eps", "")),
        "source": "checkpoint",
        "versions": json.dumps(library_versions(), sort_keys=True),
    }
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    log.info("target head: %s (tied embeddings: %s)", sorted(tensors), tied)
    return metadata


@dataclass
class TargetHead:
    """The target's LM head (or tied embedding), final norm and embedding, from save_target_head."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    final_norm: torch.Tensor | None  # [H], the target's last RMSNorm (absent in older files)
    aux_layer_ids: list[int]
    hidden_size: int
    vocab_size: int
    path: Path

    @classmethod
    def load(cls, path: str | Path) -> TargetHead:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            embed = f.get_tensor("embed_tokens.weight")
            names = set(f.keys())
            head = f.get_tensor("lm_head.weight") if "lm_head.weight" in names else embed
            norm = f.get_tensor("norm.weight") if "norm.weight" in names else None
        return cls(
            embed=embed,
            lm_head=head,
            final_norm=norm,
            aux_layer_ids=json.loads(meta["aux_layer_ids"]),
            hidden_size=int(meta["hidden_size"]),
            vocab_size=int(meta["vocab_size"]),
            path=Path(path),
        )
