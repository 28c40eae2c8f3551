"""A DFlash drafter rotates as its target: beside a YaRN target (Kimi-K2.5: x64 from 4,096) it
trains with the target's schedule, transformers' own YaRN to float precision at positions past the
unscaled range, and exports it (`rope_parameters`) with positions covering the target's, which
vLLM does not raise for a DFlash draft (VLLM-FAMILIES.md (d), vllm#57941). Beside an MLA target it
is Qwen3 attention all the same (train.drafter.attention is EAGLE-3's)."""

from __future__ import annotations

import copy

import pytest
import torch
from support.drafter_sizes import CONFIG
from support.kimi_shape import TINY_DEEPSEEK_V3

from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.dflash.export import dflash_config_from_export, dflash_export_config
from eaglenest.drafter.dflash.model import (
    DFlashConfig,
    DFlashDrafter,
    served_positions,
    target_rope_scaling,
)
from eaglenest.drafter.export_files import ExportError
from eaglenest.drafter.layers import rope_cos_sin

# A Qwen3 target with YaRN over a small unscaled range (64 positions, x4), and Kimi-K2.5's own
# (its text_config's rope_scaling: DeepSeek's mscale terms, beta 1/1, x64 from 4,096).
SMALL_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
KIMI_YARN = {
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def qwen3_target(rope: dict | None, max_positions: int = 256):
    from transformers import Qwen3Config

    theta = {"rope_theta": 10000.0}
    return Qwen3Config(
        hidden_size=CONFIG.hidden_size,
        intermediate_size=CONFIG.intermediate_size,
        num_attention_heads=CONFIG.num_attention_heads,
        num_key_value_heads=CONFIG.num_key_value_heads,
        head_dim=CONFIG.head_dim,
        vocab_size=CONFIG.vocab_size,
        num_hidden_layers=6,
        max_position_embeddings=max_positions,
        rope_parameters={**theta, **(rope or {"rope_type": "default"})},
    )


def transformers_cos_sin(target, positions: torch.Tensor):
    """The target's own rotary (Qwen3RotaryEmbedding: transformers' rope init for its type)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    x = torch.zeros(1, dtype=torch.float32)
    return Qwen3RotaryEmbedding(target)(x, positions)


def dflash_beside(target) -> DFlashConfig:
    base = DrafterConfig.from_target(target, draft_vocab_size=20, aux_layer_ids=(2, 4, 5))
    return DFlashConfig.from_drafter(
        base,
        num_hidden_layers=1,
        block_size=4,
        mask_token_id=49,
        rope_scaling=target_rope_scaling(target),
    )


@pytest.mark.parametrize(
    "rope", [SMALL_YARN, {**KIMI_YARN, "original_max_position_embeddings": 64}]
)
def test_the_yarn_rotary_is_the_targets_past_the_unscaled_range(rope):
    target = qwen3_target(rope)
    config = dflash_beside(target)
    assert config.rope_scaling["rope_type"] == "yarn"
    positions = torch.arange(0, 256, 7)[None]  # to 4x the 64 unscaled positions
    assert positions.max() > 64
    cos, sin = config.rope(positions)
    expected_cos, expected_sin = transformers_cos_sin(target, positions)
    torch.testing.assert_close(cos[:, 0], expected_cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin[:, 0], expected_sin, rtol=0, atol=2e-6)
    # An unscaled drafter would rotate otherwise past the range: what the test tells apart.
    plain_cos, _ = rope_cos_sin(positions, config.head_dim, config.rope_theta)
    assert (plain_cos[:, 0] - expected_cos).abs().max() > 0.1


def test_a_default_target_keeps_the_default_rotary():
    target = qwen3_target(None)
    config = dflash_beside(target)
    assert config.rope_scaling is None
    positions = torch.arange(0, 200, 3)[None]
    cos, sin = config.rope(positions)
    expected_cos, expected_sin = transformers_cos_sin(target, positions)
    torch.testing.assert_close(cos[:, 0], expected_cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin[:, 0], expected_sin, rtol=0, atol=2e-6)


def test_kimi_k25s_yarn_is_read_from_its_deepseek_v3_text_config():
    """Kimi-K2.5's text model is DeepSeek-V3 (MLA): the DFlash beside it is Qwen3 attention with
    the target's YaRN keys (the mscale terms make the cos/sin factor 1)."""
    from transformers import DeepseekV3Config

    # Kimi-K2.5's schedule at the tiny model's 2,048 positions: x64 from 32.
    yarn = {**KIMI_YARN, "original_max_position_embeddings": 32}
    target = DeepseekV3Config(**TINY_DEEPSEEK_V3, rope_scaling=dict(yarn), rope_theta=50000.0)
    scaling = target_rope_scaling(target)
    assert scaling == {"rope_type": "yarn", **{k: v for k, v in yarn.items() if k != "type"}}
    config = dflash_beside(target)
    assert config.rope_theta == 50000.0 and config.num_attention_heads == 2
    assert served_positions(target) == TINY_DEEPSEEK_V3["max_position_embeddings"]
    cos, _ = config.rope(torch.tensor([[0]]))
    assert cos.abs().max().item() == pytest.approx(1.0)  # attention factor 1 (mscale / mscale)
    model = DFlashDrafter(config)  # builds as Qwen3 attention beside the MLA target
    assert model.layers[0].self_attn.q_proj.out_features == 2 * config.head_dim


def test_another_rotary_schedule_is_refused_naming_it():
    target = qwen3_target({"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'linear' is not one DFlash trains with"):
        target_rope_scaling(target)


def test_the_export_carries_the_targets_scaling_and_positions():
    target = qwen3_target(SMALL_YARN, max_positions=256)
    config = dflash_beside(target)
    exported = dflash_export_config(config, "float32")
    assert exported["rope_parameters"] == {"rope_theta": 10000.0, **SMALL_YARN}
    assert (
        exported["max_position_embeddings"] == 256 > SMALL_YARN["original_max_position_embeddings"]
    )
    assert dflash_config_from_export(copy.deepcopy(exported)) == config
    for edit in (
        lambda c: c.update(rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
        lambda c: c["rope_parameters"].update(factor=8.0),
        lambda c: c.update(max_position_embeddings=64),
    ):
        misread = copy.deepcopy(exported)
        edit(misread)
        with pytest.raises(ExportError, match="vLLM 0.32 would serve another drafter"):
            dflash_config_from_export(misread)
