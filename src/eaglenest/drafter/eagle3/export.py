"""The drafter checkpoint that vLLM and SGLang load: `config.json` + `model.safetensors`.

Layout (checked against the loaders' code; see tests/workflow/test_train.py for where each key comes from):
- config.json: `architectures: ["LlamaForCausalLMEagle3"]` (SGLang's EntryClass; vLLM maps it to
  Eagle3LlamaForCausalLM), Llama sizes, `num_hidden_layers: 1`, `vocab_size` (the target's),
  `draft_vocab_size`, `target_hidden_size`, `tie_word_embeddings: false`, `rope_theta` as trained.
- Aux layer ids: vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` in HF-index form (id k
  = input of decoder layer k = `output_hidden_states[k]`), which is our convention, so it is
  written as captured. SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and captures
  layer id + 1, so the nested list holds ids - 1 (newer SGLang adds the 1 only when the first
  nested id is 1, which holds for the default (2, N//2, N-3)).
- Tensors, unprefixed: fc, midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
  input_layernorm, hidden_norm, post_attention_layernorm}, norm, lm_head, d2t (int64), t2d (bool);
  with the variants, `input_norm` (norm_before_fc) and `fc_norm.{i}` (fc_norm), as vLLM names them.
- Variants: `norm_before_fc`, `fc_norm`, `norm_before_residual`, `norm_output` as top-level
  booleans (and `eagle_config.norm_before_fc`), which is where vLLM's llama_eagle3.py reads them.
  No embed_tokens: both servers share the target's embedding, and for a large target it would be
  the biggest tensor of the file.
- A draft vocabulary that is the whole target vocabulary (`draft_vocab_size == vocab_size`, e.g.
  the default 32,000 with a 32,000-token target) ships no d2t and no t2d: the head predicts target
  ids directly, and vLLM's llama_eagle3.py and deepseek_eagle3.py create `draft_id_to_target_id`
  only when the sizes differ, refusing a checkpoint that has it. Training and own evaluation keep
  the identity mapping (d2t all 0, t2d all true) in the model, so both read it as the engine does.
- A sliding window: `layer_types: ["sliding_attention"]` and `sliding_window: N`. vLLM's
  LlamaAttention (model_executor/models/llama.py) windows a draft layer only when `layer_types`
  names it sliding (indexed past the target's `target_layer_count`), then with `sliding_window`;
  without `layer_types` it falls back to the cache config's window, not the drafter's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from eaglenest.drafter.config import MLA_SIZES, DrafterConfig
from eaglenest.drafter.eagle3.model import Eagle3Drafter
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
from eaglenest.settings.families import DRAFTER_VARIANTS

log = logging.getLogger(__name__)

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# vLLM's EAGLE-3 drafter with DeepSeek's MLA attention (model_executor/models/deepseek_eagle3.py;
# the V2 and V3 names load the same class). It reads fc_norm, norm_before_residual and
# norm_output, but not norm_before_fc: a drafter trained with that would be served without it.
MLA_ARCHITECTURE = "Eagle3DeepseekV3ForCausalLM"


def check_exportable(config: DrafterConfig) -> None:
    """A drafter the serving engine would load as another model is an error before training.
    (A window on the MLA drafter is refused with the config: settings.train.drafter_window.)"""
    if config.attention == "mla" and config.norm_before_fc:
        raise ExportError(
            "train.drafter: attention mla with norm_before_fc: vLLM's "
            f"{MLA_ARCHITECTURE} has no input norm before fc and would serve the drafter "
            "without it; set train.drafter.norm_before_fc: false"
        )


def _mla_config(config: DrafterConfig) -> dict[str, Any]:
    return {
        "architectures": [MLA_ARCHITECTURE],
        "model_type": "deepseek_v2",  # deepseek_v3 would be loaded as vLLM's MTP drafter
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": True,  # vLLM's MLA always rotates interleaved pairs
    }


def export_config(
    config: DrafterConfig,
    dtype: str,
    num_hidden_layers: int = 1,
    trained: TrainedFor | None = None,
) -> dict[str, Any]:
    """config.json of a drafter of `num_hidden_layers` decoder layers (EAGLE-3's: one);
    `trained`: what the training loop recorded (`trained_record`)."""
    check_exportable(config)
    ids = list(config.aux_layer_ids)
    architecture = (
        _mla_config(config)
        if config.attention == "mla"
        else {"architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama"}
    )
    if config.sliding_window is not None:
        # One entry per decoder layer: vLLM indexes it by the draft layer (llama.py).
        architecture["layer_types"] = ["sliding_attention"] * num_hidden_layers
        architecture["sliding_window"] = config.sliding_window
    return {
        **architecture,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "target_hidden_size": config.target_hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": num_hidden_layers,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bias": False,
        "torch_dtype": dtype,
        "eagle_aux_hidden_state_layer_ids": ids,
        **{name: getattr(config, name) for name in DRAFTER_VARIANTS},
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
            "use_aux_hidden_state": True,
            # vLLM reads norm_before_fc here first, then at the top level.
            "norm_before_fc": config.norm_before_fc,
        },
        "eaglenest": {
            "aux_layer_ids": ids,
            "format": "eagle3/1",
            "attention": config.attention,
            # Trained with the default rotary schedule (no scaling), every layer windowed alike.
            **trained_record(
                config.rope_theta, None, [config.sliding_window] * num_hidden_layers, trained
            ),
        },
    }


def export_drafter(
    model: Eagle3Drafter,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    trained: TrainedFor | None = None,
) -> None:
    out_dir = Path(out_dir)
    tensors = export_tensors(model, model.config, out_dir, dtype)
    write_export(out_dir, tensors, export_config(model.config, dtype, trained=trained))
    log.info("exported %d tensors (%s) to %s", len(tensors), dtype, out_dir)
    variant = [name for name in DRAFTER_VARIANTS if getattr(model.config, name)]
    if variant:
        # Checked against vLLM's loader only: a server that ignores a key would run another
        # drafter than the one trained, and still answer correctly, only slower.
        log.warning(
            "drafter variant %s: vLLM's llama_eagle3.py reads it from config.json; before "
            "serving this drafter with another engine (SGLang), check that it reads it too",
            ", ".join(variant),
        )


def drafter_config_from_export(config: dict[str, Any]) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=config["hidden_size"],
        target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        aux_layer_ids=tuple(config["eagle_aux_hidden_state_layer_ids"]),
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config.get("rope_theta", 10000.0),
        max_position_embeddings=config["max_position_embeddings"],
        **{name: bool(config.get(name, False)) for name in DRAFTER_VARIANTS},
        **_mla_from_export(config),
        sliding_window=_window_from_export(config),
    )


def _window_from_export(config: dict[str, Any]) -> int | None:
    """The window vLLM applies to the drafter's layers, every one (see the module doc)."""
    types = config.get("layer_types") or []
    windowed = types == ["sliding_attention"] * config.get("num_hidden_layers", 1)
    return config.get("sliding_window") if types and windowed else None


def _mla_from_export(config: dict[str, Any]) -> dict[str, Any]:
    if MLA_ARCHITECTURE not in config.get("architectures", []):
        return {}
    return {"attention": "mla", **{name: config[name] for name in MLA_SIZES}}


def load_drafter(
    drafter_dir: str | Path,
    embed: torch.Tensor,
    expect_layer_ids: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Eagle3Drafter:
    """Rebuild a drafter from its export; the embedding comes from the target (head file)."""
    drafter_dir = Path(drafter_dir)
    exported = json.loads((drafter_dir / "config.json").read_text())
    if exported.get("num_hidden_layers", 1) != 1:
        raise ExportError(
            f"{drafter_dir / 'config.json'}: num_hidden_layers "
            f"{exported['num_hidden_layers']}, but an EAGLE-3 drafter has one decoder layer"
        )
    config = drafter_config_from_export(exported)
    check_captured_layers(drafter_dir, config.aux_layer_ids, expect_layer_ids)
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise ExportError(
            f"{drafter_dir / 'config.json'}: vocab_size x hidden_size "
            f"{config.vocab_size} x {config.hidden_size} but the target embedding is "
            f"{tuple(embed.shape)}"
        )
    model = Eagle3Drafter(config)
    load_export_state(model, config, read_tensors(drafter_dir), embed, dtype)
    return model.to(dtype)
