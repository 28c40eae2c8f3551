"""P-EAGLE's export (eaglenest.drafter.p_eagle.model is the model).

Export: the project's EAGLE-3 checkpoint (eaglenest.drafter.eagle3.export,
`LlamaForCausalLMEagle3`) plus `mask_token_id` and `mask_hidden`; vLLM's loader refuses a
parallel-drafting checkpoint without `mask_hidden` (model_executor/models/llama_eagle3.py:450-455).
`parallel_drafting: true` is written too, for readers; vLLM takes it from `speculative_config`.

- Layers: `num_hidden_layers` N; layer 0 as EAGLE-3's (`midlayer.*`, which vLLM maps to
  `layers.0.`), layers 1..N-1 as `layers.{i}.*` (vLLM adds `model.`), their attention over H.
- A trained mask embedding (train.p_eagle.train_mask_embedding): `embed_tokens.weight`, the
  target's embedding with the mask token's row as trained. vLLM's loader then marks the draft
  as having its own embedding (utils.py process_eagle_weight) and the proposer keeps it, as it
  is not equal to the target's (llm_base_proposer.py `_maybe_share_embeddings`); every other
  row is the target's, so only the mask token embeds differently. Without it, no embedding is
  written and vLLM shares the target's (the mask row untrained, as trained).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.eagle3.export import (
    EAGLE3_ARCHITECTURE,
    check_exportable,
    drafter_config_from_export,
    export_config,
)
from eaglenest.drafter.export_files import (
    DTYPES,
    ExportError,
    TrainedFor,
    check_captured_layers,
    export_tensors,
    load_export_state,
    read_tensors,
    write_export,
)
from eaglenest.drafter.p_eagle.model import PEagleDrafter
from eaglenest.settings.families import FAMILY_SPECS, MASK_TOKEN_KEYS

P_EAGLE_FORMAT = "p_eagle/1"
EMBEDDING = "embed_tokens.weight"


@dataclass(frozen=True)
class PEagleExport:
    """What a P-EAGLE config.json says vLLM serves, checked against what was trained."""

    drafter: DrafterConfig
    mask_token_id: int
    depths: int
    num_hidden_layers: int
    train_mask_embedding: bool


def check_p_eagle_exportable(config: DrafterConfig) -> None:
    """Before training: a P-EAGLE drafter vLLM 0.32 could not serve as trained."""
    check_exportable(config)
    if config.attention != "llama":
        raise ExportError(
            f"P-EAGLE with attention {config.attention}: vLLM's MLA EAGLE-3 drafter "
            "(deepseek_eagle3.py) has no mask_hidden and drafts no parallel tokens; "
            "use attention: llama"
        )


def p_eagle_export_config(
    model: PEagleDrafter, dtype: str, depths: int, trained: TrainedFor | None = None
) -> dict[str, Any]:
    """config.json: the EAGLE-3 export's with the model's layers, the mask token and the
    trained depths."""
    check_p_eagle_exportable(model.config)
    config = export_config(model.config, dtype, model.num_hidden_layers, trained)
    config["mask_token_id"] = model.mask_token_id
    config["parallel_drafting"] = True  # for readers; vLLM reads speculative_config's
    config["eaglenest"] = {
        **config["eaglenest"],
        "format": P_EAGLE_FORMAT,
        "mask_token_id": model.mask_token_id,
        "depths": depths,
        "num_hidden_layers": model.num_hidden_layers,
        "train_mask_embedding": model.train_mask_embedding,
    }
    return config


def export_p_eagle(
    model: PEagleDrafter,
    out_dir: str | Path,
    depths: int,
    dtype: str = "bfloat16",
    trained: TrainedFor | None = None,
) -> None:
    """config.json + model.safetensors: vLLM's EAGLE-3 names for every layer, `mask_hidden`
    and, with a trained mask embedding, the embedding table (module doc)."""
    out_dir = Path(out_dir)
    config = p_eagle_export_config(model, dtype, depths, trained)
    p_eagle_from_export(config)  # what vLLM would read is what was trained, or no export
    tensors = export_tensors(model, model.config, out_dir, dtype)
    tensors.pop("mask_embedding_delta", None)  # served inside the table
    if model.train_mask_embedding:
        with torch.no_grad():
            table = model.embed_tokens.weight.detach().clone()
            table[model.mask_token_id] = model.mask_embedding()
        tensors[EMBEDDING] = table.to(DTYPES[dtype]).cpu().contiguous()
    write_export(out_dir, tensors, config)


def vllm_mask_token_id(config: dict[str, Any]) -> int | None:
    """The mask token vLLM 0.32 drafts with for this config.json (llm_base_proposer.py:356-379):
    dflash_config's first, then the first of MASK_TOKEN_KEYS present."""
    nested = config.get("dflash_config") or {}
    if "mask_token_id" in nested:
        return nested["mask_token_id"]
    for key in MASK_TOKEN_KEYS:
        if config.get(key) is not None:
            return config[key]
    return None


def p_eagle_from_export(config: dict[str, Any]) -> PEagleExport:
    """What vLLM 0.32 serves of a P-EAGLE config.json, refused where it would read another
    drafter than the one recorded as trained (`eaglenest`)."""
    trained = config.get("eaglenest") or {}
    if trained.get("format") != P_EAGLE_FORMAT:
        raise ExportError(
            f"config.json: eaglenest.format {trained.get('format')!r}, not {P_EAGLE_FORMAT}"
        )
    if config.get("architectures") != [EAGLE3_ARCHITECTURE]:
        raise ExportError(
            f"config.json: architectures {config.get('architectures')} but P-EAGLE is exported "
            f"as [{EAGLE3_ARCHITECTURE!r}] (vLLM's Eagle3LlamaForCausalLM reads mask_hidden)"
        )
    layers = trained.get("num_hidden_layers", 1)  # exports before layers: one
    if config.get("num_hidden_layers") != layers:
        raise ExportError(
            f"config.json: num_hidden_layers {config.get('num_hidden_layers')}, trained {layers}"
        )
    served = vllm_mask_token_id(config)
    if served != trained.get("mask_token_id"):
        raise ExportError(
            f"config.json: vLLM would draft with mask token {served} (dflash_config."
            "mask_token_id, mask_token_id, dspark_noise_token_id, pard_token, ptd_token_id, "
            f"first found) but the drafter was trained with {trained.get('mask_token_id')}"
        )
    drafter = drafter_config_from_export(config)
    if list(drafter.aux_layer_ids) != list(trained.get("aux_layer_ids", [])):
        raise ExportError(
            f"config.json: vLLM would capture layers {list(drafter.aux_layer_ids)} "
            f"(eagle_aux_hidden_state_layer_ids) but the drafter was trained on "
            f"{trained.get('aux_layer_ids')}"
        )
    return PEagleExport(
        drafter,
        served,
        int(trained["depths"]),
        layers,
        bool(trained.get("train_mask_embedding", False)),
    )


def load_p_eagle(
    drafter_dir: str | Path,
    embed: torch.Tensor,
    expect_layer_ids: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[PEagleDrafter, int]:
    """The drafter of an export and its trained depths. Its embedding is the table vLLM
    embeds with: the export's where it has one (a trained mask row), else the target's."""
    drafter_dir = Path(drafter_dir)
    served = p_eagle_from_export(json.loads((drafter_dir / "config.json").read_text()))
    config = served.drafter
    check_captured_layers(drafter_dir, config.aux_layer_ids, expect_layer_ids)
    # The delta is zero here: the export's table already holds the trained row.
    model = PEagleDrafter(
        config, served.mask_token_id, served.num_hidden_layers, served.train_mask_embedding
    )
    state = read_tensors(drafter_dir)
    if "mask_hidden" not in state or state["mask_hidden"].numel() != model.mask_hidden.numel():
        raise ExportError(
            f"{drafter_dir / 'model.safetensors'}: no mask_hidden of "
            f"{model.mask_hidden.numel()} values (n_aux x target_hidden_size), which vLLM "
            "needs to draft in parallel (llama_eagle3.py:440-455)"
        )
    state["mask_hidden"] = state["mask_hidden"].reshape(-1)
    table = served_embedding(drafter_dir, served, state.pop(EMBEDDING, None), embed)
    if model.mask_embedding_delta is not None:
        state["mask_embedding_delta"] = torch.zeros_like(model.mask_embedding_delta)
    load_export_state(model, config, state, table, dtype)
    return model.to(dtype), served.depths


def served_embedding(
    drafter_dir: Path, served: PEagleExport, exported: torch.Tensor | None, target: torch.Tensor
) -> torch.Tensor:
    """The embedding vLLM embeds this export's tokens with: its own table where it has one
    (trained mask row), refused unless it is the target's but for that row; else the target's."""
    where = drafter_dir / "model.safetensors"
    if exported is None:
        if served.train_mask_embedding:
            raise ExportError(
                f"{where}: no {EMBEDDING}, but the mask embedding was trained: vLLM would "
                "embed the mask token with the target's row"
            )
        return target
    if not served.train_mask_embedding:
        raise ExportError(
            f"{where}: an {EMBEDDING} but the mask embedding was not trained "
            "(eaglenest.train_mask_embedding false)"
        )
    if exported.shape != target.shape:
        raise ExportError(
            f"{where}: {EMBEDDING} {tuple(exported.shape)}, the target's is {tuple(target.shape)}"
        )
    others = torch.ones(len(target), dtype=torch.bool)
    others[served.mask_token_id] = False
    if not torch.equal(exported[others], target[others].to(exported.dtype)):
        raise ExportError(
            f"{where}: {EMBEDDING} differs from the target's embedding in rows other than "
            f"the mask token's ({served.mask_token_id})"
        )
    return exported


def p_eagle_speculative_config(drafter_dir: str | Path, k: int, depths: int) -> dict[str, Any]:
    """vLLM's `speculative_config` serving the export with K drafted tokens (K <= depths)."""
    if not 1 <= k <= depths:
        raise ValueError(f"P-EAGLE trained {depths} depths: it drafts 1..{depths} tokens, not {k}")
    return {
        "method": FAMILY_SPECS["p_eagle"].vllm_method,
        "model": str(drafter_dir),
        "num_speculative_tokens": k,
        "parallel_drafting": True,
    }
