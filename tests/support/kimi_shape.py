"""Targets with Kimi-K2.5's shape: `KimiK25ForConditionalGeneration`, a DeepSeek-V3 language model
nested as `text_config` beside a vision tower, its tensors under `language_model.` in a sharded
safetensors checkpoint. transformers 5 reads the config itself (model_type kimi_k25, its text
model `kimi_k2` = deepseek_v3), so no remote code is needed for the config.

`write_kimi_config` writes config.json alone (enough for the stages that read only the config,
at Kimi-K2.5's real sizes); `build_kimi_shaped_target` adds a tiny random DeepSeek-V3 with the
given tokenizer, in that layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Kimi-K2.5's language model, as its config.json's text_config gives it.
KIMI_K25_TEXT = {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163_840}

# A DeepSeek-V3 small enough to build in a second: MLA attention, MoE with a shared expert, the
# first layer dense, as the real one.
TINY_DEEPSEEK_V3 = {
    "num_hidden_layers": 8,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 2048,
    "vocab_size": 512,  # above the tokenizer's length, as Kimi-K2.5's 163,840
}


def write_kimi_config(out_dir: Path, text: dict) -> Path:
    """config.json with Kimi-K2.5's nesting: the language model's sizes only under text_config
    (the top level says tie_word_embeddings true by default; the text model does not tie)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "kimi_k2",
            "tie_word_embeddings": False,
            **text,
        },
        "vision_config": {"model_type": "kimi_k25_vision", "hidden_size": 32},
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def build_kimi_shaped_target(out_dir: Path, tokenizer_dir: Path) -> dict:
    """A tiny random DeepSeek-V3 in Kimi-K2.5's layout at `out_dir`, with the tokenizer files
    of `tokenizer_dir`; returns its language model's state dict (names without the prefix)."""
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY_DEEPSEEK_V3, tie_word_embeddings=False))
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    write_kimi_config(out_dir, TINY_DEEPSEEK_V3)
    for path in tokenizer_dir.iterdir():
        if path.is_file():
            shutil.copy(path, out_dir / path.name)
    # Two shards as the real checkpoint's: the language model, and the vision tower and
    # projector, whose norms end like the language model's.
    language = {f"language_model.{name}": t for name, t in state.items()}
    vision = {
        "vision_tower.encoder.final_layernorm.weight": torch.ones(32),
        "vision_tower.model.norm.weight": torch.ones(32),
        "mm_projector.proj.0.weight": torch.zeros(64, 32),
    }
    shards = {"model-00001-of-00002.safetensors": language}
    shards["model-00002-of-00002.safetensors"] = vision
    weight_map = {}
    for file_name, tensors in shards.items():
        save_file(tensors, str(out_dir / file_name))
        weight_map |= dict.fromkeys(tensors, file_name)
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return state


def write_tokens(path: Path, lengths: list[int]) -> Path:
    """A tokens shard of samples of these lengths (what the hidden stage reads of one)."""
    import polars as pl

    pl.DataFrame(
        {
            "id": [f"{i:016x}" for i in range(len(lengths))],
            "input_ids": [list(range(n)) for n in lengths],
            "prompt_len": [1] * len(lengths),
            "n_tokens": lengths,
        }
    ).write_parquet(path)
    return path
