"""The drafter's test sizes: small enough for a step in milliseconds on the CPU, with grouped
query attention (4 heads over 2 KV heads) and a draft vocabulary smaller than the target's."""

from __future__ import annotations

from eaglenest.drafter.config import DrafterConfig

CONFIG = DrafterConfig(
    hidden_size=32,
    target_hidden_size=24,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=50,
    draft_vocab_size=20,
    aux_layer_ids=(2, 4, 5),
)
