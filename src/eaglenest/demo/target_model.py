"""The demo target's model: an untrained Qwen3 (dense) or DeepSeek-V3 (MLA + MoE) causal LM at
demo sizes, sized to the demo tokenizer."""

from __future__ import annotations

from typing import Any

from eaglenest.demo.tasks import END_OF_TURN, PAD_TOKEN

# DeepSeek-V3's shape (Kimi-K2, Kimi-K2.5) at the sizes vLLM's CPU kernels take: MLA with a
# latent of kv_lora_rank 512 + qk_rope_head_dim 64 (CPU MLA's only head size), hidden and expert
# sizes that are multiples of 32 (its fused MoE), the first layer dense, then routed experts
# with one shared expert and DeepSeek-V3's sigmoid routing with a correction bias (noaux_tc).
DEEPSEEK_V3_DEFAULTS = {
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
ARCHITECTURES = ("qwen3", "deepseek_v3")


def _qwen3_config(shared: dict[str, Any], num_kv_heads: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        **shared,
        num_key_value_heads=num_kv_heads,
        head_dim=shared["hidden_size"] // shared["num_attention_heads"],
        tie_word_embeddings=True,
    )


def _deepseek_v3_config(shared: dict[str, Any], deepseek_v3: dict[str, Any]) -> Any:
    from transformers import DeepseekV3Config

    sizes = {**DEEPSEEK_V3_DEFAULTS, **deepseek_v3}
    return DeepseekV3Config(
        **shared,
        **sizes,
        num_key_value_heads=shared["num_attention_heads"],
        n_group=1,  # one expert group: group-limited routing needs more experts than a demo has
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        # As DeepSeek-V3's and Kimi-K2's config.json say it: transformers implies both, but
        # vLLM reads them (without topk_method it has no correction bias to load).
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        rope_interleave=True,  # as DeepSeek's checkpoints (and their reference code) rotate
        tie_word_embeddings=False,  # a separate LM head, as in DeepSeek-V3 and Kimi-K2.5
    )


def make_model(
    tokenizer: Any,
    *,
    architecture: str,
    vocab_size: int,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int = 1024,
    deepseek_v3: dict[str, Any] | None = None,
) -> Any:
    from transformers import DeepseekV3ForCausalLM, Qwen3ForCausalLM

    if architecture not in ARCHITECTURES:
        raise ValueError(f"demo_target.architecture {architecture!r}: one of {ARCHITECTURES}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    shared = {
        # Like Qwen's checkpoints, the embedding may have more rows than the tokenizer has
        # tokens; later stages must size things by config.vocab_size, and this keeps them honest.
        "vocab_size": max(vocab_size, len(tokenizer)),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "max_position_embeddings": max_position_embeddings,
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        "eos_token_id": tokenizer.convert_tokens_to_ids(END_OF_TURN),
        "bos_token_id": None,
        "use_cache": True,
    }
    if architecture == "qwen3":
        return Qwen3ForCausalLM(_qwen3_config(shared, num_kv_heads))
    return DeepseekV3ForCausalLM(_deepseek_v3_config(shared, deepseek_v3 or {}))
