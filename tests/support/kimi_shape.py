"""Targets with Kimi-K2.5's shape: `KimiK25ForConditionalGeneration`, a DeepSeek-V3 language model
nested as `text_config` beside a vision tower, its tensors under `language_model.` in a sharded
safetensors checkpoint. transformers 5 reads the config itself (model_type kimi_k25, its text
model `kimi_k2` = deepseek_v3), so no remote code is needed for the config.

Both wrap with the demo's own code (demo/kimi_layout.py), so the tests meet the layout the demo
target (`demo_target.layout: kimi_k25`) and the engine tests serve: `write_kimi_config` writes
config.json alone (enough for the stages that read only the config, at Kimi-K2.5's real sizes);
`build_kimi_shaped_target` wraps a tiny random DeepSeek-V3 with the given tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eaglenest.demo.kimi_layout import kimi_config, wrap_kimi_k25

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
    """config.json alone, as the demo's wrap writes it (demo/kimi_layout.kimi_config) around a
    DeepSeek-V3 text model of these sizes: the language model's sizes only under text_config."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text_config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "tie_word_embeddings": False,
        **text,
    }
    (out_dir / "config.json").write_text(json.dumps(kimi_config(text_config), indent=2) + "\n")
    return out_dir


def build_kimi_shaped_target(out_dir: Path, tokenizer_dir: Path) -> dict:
    """A tiny random DeepSeek-V3 with the tokenizer files of `tokenizer_dir`, wrapped in
    Kimi-K2.5's layout at `out_dir` by the demo's own wrap (demo/kimi_layout.wrap_kimi_k25:
    the language model under `language_model.` in one shard, a vision tower and projector in a
    second); returns the language model's state dict (names without the prefix)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY_DEEPSEEK_V3, tie_word_embeddings=False))
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    model.save_pretrained(out_dir)
    for path in tokenizer_dir.iterdir():
        if path.is_file():
            shutil.copy(path, out_dir / path.name)
    wrap_kimi_k25(out_dir, out_dir)  # in place: the text model's files become the wrapper's
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
