"""P-EAGLE's export (eaglenest.drafter.p_eagle.model is the model).

Export: the project's EAGLE-3 checkpoint (eaglenest.drafter.eagle3.export,
`LlamaForCausalLMEagle3`) plus `mask_token_id` and `mask_hidden`; vLLM's loader refuses a
parallel-drafting checkpoint without `mask_hidden` (model_executor/models/llama_eagle3.py:450-455).
`parallel_drafting: true` is written too, for readers; vLLM takes it from `speculative_config`
(`speculative_config`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eaglenest.common.io import write_json
from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.eagle3.export import (
    EAGLE3_ARCHITECTURE,
    check_exportable,
    drafter_config_from_export,
    export_config,
    export_drafter,
)
from eaglenest.drafter.export_files import (
    ExportError,
    check_captured_layers,
    load_export_state,
    read_tensors,
)
from eaglenest.drafter.p_eagle.model import PEagleDrafter
from eaglenest.settings.families import FAMILY_SPECS, MASK_TOKEN_KEYS

P_EAGLE_FORMAT = "p_eagle/1"


def check_p_eagle_exportable(config: DrafterConfig) -> None:
    """Before training: a P-EAGLE drafter vLLM 0.32 could not serve as trained."""
    check_exportable(config)
    if config.attention != "llama":
        raise ExportError(
            f"P-EAGLE with attention {config.attention}: vLLM's MLA EAGLE-3 drafter "
            "(deepseek_eagle3.py) has no mask_hidden and drafts no parallel tokens; "
            "use attention: llama"
        )


def p_eagle_export_config(model: PEagleDrafter, dtype: str, depths: int) -> dict[str, Any]:
    """config.json: the EAGLE-3 export's, with the mask token and the trained depths."""
    check_p_eagle_exportable(model.config)
    config = export_config(model.config, dtype)
    config["mask_token_id"] = model.mask_token_id
    config["parallel_drafting"] = True  # for readers; vLLM reads speculative_config's
    config["eaglenest"] = {
        **config["eaglenest"],
        "format": P_EAGLE_FORMAT,
        "mask_token_id": model.mask_token_id,
        "depths": depths,
    }
    return config


def export_p_eagle(
    model: PEagleDrafter, out_dir: str | Path, depths: int, dtype: str = "bfloat16"
) -> None:
    """config.json + model.safetensors, vLLM's EAGLE-3 names plus `mask_hidden`."""
    config = p_eagle_export_config(model, dtype, depths)
    p_eagle_from_export(config)  # what vLLM would read is what was trained, or no export
    # The EAGLE-3 export writes every trainable tensor (mask_hidden among them, [n_aux·H]),
    # then its own config.json, which this family's replaces.
    export_drafter(model, out_dir, dtype=dtype)
    write_json(Path(out_dir) / "config.json", config)


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


def p_eagle_from_export(config: dict[str, Any]) -> tuple[DrafterConfig, int, int]:
    """(drafter config, mask token id, trained depths) of a P-EAGLE config.json, refused where
    vLLM 0.32 would read another drafter than the one recorded as trained (`eaglenest`)."""
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
    if config.get("num_hidden_layers") != 1:
        raise ExportError(
            f"config.json: num_hidden_layers {config.get('num_hidden_layers')}, trained 1"
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
    return drafter, served, int(trained["depths"])


def load_p_eagle(
    drafter_dir: str | Path,
    embed: torch.Tensor,
    expect_layer_ids: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[PEagleDrafter, int]:
    """The drafter of an export (its embedding from the target) and its trained depths."""
    drafter_dir = Path(drafter_dir)
    config, mask_token_id, depths = p_eagle_from_export(
        json.loads((drafter_dir / "config.json").read_text())
    )
    check_captured_layers(drafter_dir, config.aux_layer_ids, expect_layer_ids)
    model = PEagleDrafter(config, mask_token_id)
    state = read_tensors(drafter_dir)
    if "mask_hidden" not in state or state["mask_hidden"].numel() != model.mask_hidden.numel():
        raise ExportError(
            f"{drafter_dir / 'model.safetensors'}: no mask_hidden of "
            f"{model.mask_hidden.numel()} values (n_aux x target_hidden_size), which vLLM "
            "needs to draft in parallel (llama_eagle3.py:440-455)"
        )
    state["mask_hidden"] = state["mask_hidden"].reshape(-1)
    load_export_state(model, config, state, embed, dtype)
    return model.to(dtype), depths


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
