"""The DFlash checkpoint vLLM 0.32 loads (eaglenest.drafter.dflash.model is the model):
`config.json` + `model.safetensors`, as VLLM-FAMILIES.md measured it serving (its plain-torch
forward matched vLLM's drafts 64/64).

- config.json: `architectures: ["DFlashDraftModel"]` (vLLM's registry maps it to
  qwen3_dflash.DFlashQwen3ForCausalLM, model_executor/models/registry.py:634), `model_type:
  qwen3`, the Qwen3 sizes, `rope_parameters`, `block_size`, `dflash_config {block_size,
  mask_token_id, target_layer_ids}` (target ids in DFlash's convention, dflash.py's
  `dflash_target_layer_ids`); `draft_vocab_size` and `target_hidden_size`, which vLLM reads
  (qwen3_dflash.py DFlashQwen3ForCausalLM and `_get_dflash_fc_input_size`); `num_target_layers`
  (z-lab's key, read by no vLLM code) when known; and `eaglenest`: the trained config.
- Tensors, unprefixed (vLLM adds `model.`): layers.{i}.self_attn.{q,k,v,o}_proj,
  layers.{i}.self_attn.{q,k}_norm, layers.{i}.mlp.{gate,up,down}_proj,
  layers.{i}.{input,post_attention}_layernorm, fc, hidden_norm, norm, and with a head of its own
  (`head` draft) lm_head, and d2t/t2d when the draft vocabulary is smaller than the target's
  (none when it is the whole: vLLM creates draft_id_to_target_id only then, qwen3_dflash.py
  DFlashQwen3ForCausalLM). No embed_tokens: vLLM shares the target's, mask token included, as
  training did. With the target's head (`head` target) no lm_head and no d2t either: vLLM finds
  no lm_head in the checkpoint (`has_own_lm_head` stays False, model_executor/models/utils.py
  `process_eagle_weight`) and shares the target's (v1/spec_decode/llm_base_proposer.py
  `_maybe_share_lm_head`), over the whole vocabulary (draft_vocab_size = vocab_size). No
  mask_hidden: vLLM asserts it away (qwen3_dflash.py:891).

A config that vLLM would read as another drafter than the one trained is refused on export and
on load (`dflash_config_from_export`): `vllm_dflash_reading` reads it with vLLM's precedence
(causality, sliding windows, mask token, captured layers, rotary base...) and every value must be
the trained one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from eaglenest.drafter.dflash.model import (
    DFlashConfig,
    DFlashDrafter,
    aux_layer_ids_from_dflash,
    dflash_target_layer_ids,
)
from eaglenest.drafter.export_files import (
    ExportError,
    TrainedFor,
    check_captured_layers,
    export_tensors,
    load_export_state,
    read_tensors,
    trained_record,
    write_export,
)
from eaglenest.drafter.vocab_head import INTEGER_TENSORS, is_full_vocab
from eaglenest.settings.families import FAMILY_SPECS, block_served_k

log = logging.getLogger(__name__)

DFLASH_ARCHITECTURE = "DFlashDraftModel"
DFLASH_FORMAT = "dflash/1"
SLIDING = "sliding_attention"
# transformers' Qwen3Config default (configuration_qwen3.py): layers from here on slide when
# use_sliding_window is set and layer_types is not.
QWEN3_MAX_WINDOW_LAYERS = 28
LAYER_TENSORS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


def weight_names(config: DFlashConfig) -> set[str]:
    """The tensors of an export, exactly."""
    names = {
        f"layers.{i}.{tensor}.weight"
        for i in range(config.num_hidden_layers)
        for tensor in LAYER_TENSORS
    }
    names |= {"fc.weight", "hidden_norm.weight", "norm.weight"}
    if not config.target_head:
        names.add("lm_head.weight")
    return names if is_full_vocab(config) else names | set(INTEGER_TENSORS)


def dflash_export_config(
    config: DFlashConfig,
    dtype: str,
    num_target_layers: int | None = None,
    gamma: float | None = None,
    trained: TrainedFor | None = None,
) -> dict[str, Any]:
    """config.json; `gamma`, the slot decay it was trained with, recorded in its eaglenest
    section (no reader: the run's record), and what the loop recorded (`trained_record`)."""
    out = {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": rope_parameters(config),
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "block_size": config.block_size,
        "dflash_config": {
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": dflash_target_layer_ids(config.aux_layer_ids),
        },
        "eaglenest": {
            "format": DFLASH_FORMAT,
            "config": config.to_dict(),
            # Full attention in every layer: DFlash is trained without a window (from_drafter).
            **trained_record(
                config.rope_theta,
                config.rope_scaling,
                [None] * config.num_hidden_layers,
                trained,
            ),
        },
    }
    if gamma is not None:
        out["eaglenest"]["gamma"] = gamma
    if num_target_layers is not None:
        out["num_target_layers"] = num_target_layers
    return out


def rope_parameters(config: DFlashConfig) -> dict[str, Any]:
    """config.json's `rope_parameters`: the rotary base and the target's schedule as trained
    (`DFlashConfig.rope_scaling`: YaRN's keys, which vLLM's get_rope reads for a Qwen3 DFlash)."""
    return {"rope_theta": config.rope_theta, **(config.rope_scaling or {"rope_type": "default"})}


def export_dflash(
    model: DFlashDrafter,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    num_target_layers: int | None = None,
    gamma: float | None = None,
    trained: TrainedFor | None = None,
) -> None:
    out_dir = Path(out_dir)
    config = dflash_export_config(model.config, dtype, num_target_layers, gamma, trained)
    dflash_config_from_export(config)  # what vLLM would read is what was trained, or no export
    tensors = export_tensors(model, model.config, out_dir, dtype)
    if set(tensors) != weight_names(model.config):
        raise ExportError(f"{out_dir}: tensors {sorted(set(tensors) ^ weight_names(model.config))}")
    write_export(out_dir, tensors, config)
    log.info("exported DFlash drafter, %d tensors (%s), to %s", len(tensors), dtype, out_dir)


# ---- what vLLM 0.32 reads ---------------------------------------------------------------------


def vllm_layer_types(config: dict[str, Any]) -> list[str]:
    """`layer_types` as transformers' Qwen3Config fills it when absent (configuration_qwen3.py)."""
    n = config.get("num_hidden_layers", 0)
    if config.get("layer_types"):
        return list(config["layer_types"])
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None
    first = config.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
    return [SLIDING if window is not None and i >= first else "full_attention" for i in range(n)]


def vllm_causal(config: dict[str, Any], layer: int) -> bool:
    """qwen3_dflash.py:86-97: `is_causal`, else dflash_config.causal, else a sliding layer."""
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    override = (config.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override)
    return vllm_layer_types(config)[layer] == SLIDING


def vllm_aux_layer_ids(config: dict[str, Any]) -> tuple[int, ...] | None:
    """The layers vLLM captures for the drafter (v1/worker/gpu_model_runner.py:5268-5283):
    the top-level EAGLE-3 list, else dflash_config's ids + 1, else (overriding those)
    eagle_config's list."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        nested, eagle = config.get("dflash_config"), config.get("eagle_config")
        if nested and isinstance(nested, dict):
            ids = list(aux_layer_ids_from_dflash(nested.get("target_layer_ids") or []))
        if eagle and isinstance(eagle, dict):
            ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return tuple(ids) if ids else None


def vllm_dflash_reading(config: dict[str, Any]) -> dict[str, Any]:
    """What vLLM 0.32's DFlash path takes from this config.json, by its own precedence."""
    nested = config.get("dflash_config") or {}
    merged = {**(config.get("eagle_config") or {}), **nested}  # qwen3_dflash.py:451-452
    n = config.get("num_hidden_layers", 0)
    types = vllm_layer_types(config)
    rope = config.get("rope_parameters") or {}
    return {
        "architectures": config.get("architectures"),
        "model_type": config.get("model_type"),
        "causal": [vllm_causal(config, i) for i in range(n)],
        # qwen3_dflash.py:120-170: dflash_config.use_swa, or the layer's type.
        "sliding": [bool(nested.get("use_swa")) or types[i] == SLIDING for i in range(n)],
        # The proposer's (llm_base_proposer.py:363-367) and the model's (qwen3_dflash.py:472).
        "mask_token_id": nested.get("mask_token_id", config.get("mask_token_id")),
        "model_mask_token_id": merged.get("mask_token_id", config.get("mask_token_id")),
        "aux_layer_ids": vllm_aux_layer_ids(config),
        # No default: vLLM's would be 1e6 (qwen3_dflash.py:337), transformers' another.
        "rope_theta": rope.get("rope_theta"),
        "rope_type": rope.get("rope_type", "default"),
        # get_rope's yarn branch (rotary_embedding/__init__.py:243-283) reads these keys.
        "rope_scaling": {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")},
        # vLLM does not raise a DFlash draft's to the target's max_model_len (it does an
        # EAGLE-3 draft's, config/speculative.py:1393-1400): what covers the served length.
        "max_position_embeddings": config.get("max_position_embeddings"),
        "is_neox_style": config.get("is_neox_style", True),  # qwen3_dflash.py:357
        "attention_value_scale": nested.get("attention_value_scale"),
        "attention_sink_bias": nested.get(
            "attention_sink_bias", config.get("add_swa_attention_sink_bias", False)
        ),
        "use_aux_hidden_state": merged.get(
            "use_aux_hidden_state", config.get("use_aux_hidden_state", True)
        ),
        # The V2 runner refuses it (v1/worker/gpu/spec_decode/dflash/speculator.py:80).
        "sample_from_anchor": nested.get("sample_from_anchor", False),
        "draft_vocab_size": config.get("draft_vocab_size") or config.get("vocab_size"),
        "target_hidden_size": config.get("target_hidden_size") or config.get("hidden_size"),
        "hidden_act": config.get("hidden_act"),
        "attention_bias": config.get("attention_bias", False),
        **{name: config.get(name) for name in SIZES},
    }


SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
)


def trained_reading(config: DFlashConfig) -> dict[str, Any]:
    """What `vllm_dflash_reading` must find for the drafter that was trained."""
    n = config.num_hidden_layers
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "causal": [False] * n,
        "sliding": [False] * n,
        "mask_token_id": config.mask_token_id,
        "model_mask_token_id": config.mask_token_id,
        "aux_layer_ids": tuple(config.aux_layer_ids),
        "rope_theta": config.rope_theta,
        "rope_type": (config.rope_scaling or {}).get("rope_type", "default"),
        "rope_scaling": {k: v for k, v in (config.rope_scaling or {}).items() if k != "rope_type"},
        "max_position_embeddings": config.max_position_embeddings,
        "is_neox_style": True,
        "attention_value_scale": None,
        "attention_sink_bias": False,
        "use_aux_hidden_state": True,
        "sample_from_anchor": False,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "hidden_act": "silu",
        "attention_bias": False,
        **{name: getattr(config, name) for name in SIZES},
    }


def dflash_config_from_export(config: dict[str, Any]) -> DFlashConfig:
    """The trained config of a DFlash config.json, refused (ExportError naming every key) where
    vLLM 0.32 would read another drafter."""
    recorded = config.get("eaglenest") or {}
    if recorded.get("format") != DFLASH_FORMAT:
        raise ExportError(
            f"config.json: eaglenest.format {recorded.get('format')!r}, not {DFLASH_FORMAT}"
        )
    trained = DFlashConfig.from_dict(recorded["config"])
    read, expected = vllm_dflash_reading(config), trained_reading(trained)
    wrong = [
        f"{key}: vLLM reads {read[key]!r}, trained {value!r}"
        for key, value in expected.items()
        if read[key] != value
    ]
    if wrong:
        raise ExportError(
            "config.json: vLLM 0.32 would serve another drafter than the one trained: "
            + "; ".join(wrong)
        )
    return trained


def load_dflash(
    drafter_dir: str | Path,
    embed: torch.Tensor,
    expect_layer_ids: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    lm_head: torch.Tensor | None = None,
) -> DFlashDrafter:
    """Rebuild a drafter from its export; the embedding comes from the target (head file), and
    so does the LM head [V, H] of a drafter with the target's (`head` target)."""
    drafter_dir = Path(drafter_dir)
    config = dflash_config_from_export(json.loads((drafter_dir / "config.json").read_text()))
    check_captured_layers(drafter_dir, config.aux_layer_ids, expect_layer_ids)
    state = read_tensors(drafter_dir)
    if set(state) != weight_names(config):
        raise ExportError(
            f"{drafter_dir / 'model.safetensors'}: missing "
            f"{sorted(weight_names(config) - set(state))}, unexpected "
            f"{sorted(set(state) - weight_names(config))}"
        )
    if config.target_head:
        if lm_head is None or tuple(lm_head.shape) != (config.vocab_size, config.hidden_size):
            raise ExportError(
                f"{drafter_dir / 'config.json'}: a DFlash drafter with the target's head needs "
                f"the target's LM head [{config.vocab_size}, {config.hidden_size}] (the target "
                f"head file), got {None if lm_head is None else tuple(lm_head.shape)}"
            )
        state = {**state, "lm_head.weight": lm_head}
    model = DFlashDrafter(config)
    load_export_state(model, config, state, embed, dtype)
    return model.to(dtype)


def dflash_speculative_config(
    drafter_dir: str | Path, config: DFlashConfig, k: int | None = None
) -> dict[str, Any]:
    """vLLM's `speculative_config` serving the export at K drafted tokens (the bonus token takes
    the block's first slot): any K up to block_size - 1, by default that (`block_ks`)."""
    top = block_served_k(config.block_size)
    k = top if k is None else k
    if not 1 <= k <= top:
        raise ValueError(f"a DFlash drafter of block_size {config.block_size} drafts 1..{top}")
    return {
        "method": FAMILY_SPECS["dflash"].vllm_method,
        "model": str(drafter_dir),
        "num_speculative_tokens": k,
    }
