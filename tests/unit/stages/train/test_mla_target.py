"""Every family's drafter beside an MLA target with YaRN (Kimi-K2.5's kind, at a tiny size), as
the train stage builds it from one config with `train.drafter.attention: mla`: EAGLE-3 is the MLA
drafter, P-EAGLE llama attention and DFlash Qwen3 attention (train.drafter.attention is
EAGLE-3's: vLLM has no MLA parallel drafter), DFlash rotating by the target's YaRN over the
target's positions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.kimi_shape import TINY_DEEPSEEK_V3

from eaglenest.common.config import validate_config
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.formats.target_head import TargetHead
from eaglenest.settings.families import FAMILIES
from eaglenest.settings.train import (
    FamilySettings,
    TrainSettings,
    train_job_settings,
    train_job_settings_json,
)
from eaglenest.stages.train.families import RECIPES

YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 32,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
AUX = [1, 2, 3]


def kimi_like_target():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**TINY_DEEPSEEK_V3, rope_scaling=dict(YARN), rope_theta=50000.0)


def job_settings(config: dict, family: str) -> tuple[TrainSettings, FamilySettings]:
    """The family's settings as its train_drafter job reads them back from its param."""
    whole = TrainSettings.from_config(config).to_json()
    return train_job_settings(train_job_settings_json(whole, config, family))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_built_beside_an_mla_target_with_its_own_attention(family):
    target = kimi_like_target()
    vocab_size, hidden = target.vocab_size, target.hidden_size
    head = TargetHead(
        embed=torch.randn(vocab_size, hidden), lm_head=torch.randn(vocab_size, hidden),
        final_norm=torch.ones(hidden), aux_layer_ids=AUX, hidden_size=hidden,
        vocab_size=vocab_size, path=Path("head.safetensors"),
    )  # fmt: skip
    vocab = DraftVocab(d2t=torch.zeros(vocab_size, dtype=torch.long), t2d=torch.ones(vocab_size, dtype=torch.bool))  # fmt: skip
    train = {"families": list(FAMILIES), "mask_token_id": vocab_size - 1, "device": "cpu",
             "drafter": {"attention": "mla", "norm_before_fc": False},
             "dflash": {"block_size": 4}}  # fmt: skip
    config = validate_config({"train": train, "target": {"path": "kimi-like"}})
    settings, own = job_settings(config, family)
    model = RECIPES[family](target, head, vocab, settings, own).model
    attention = type(model.layers[0].self_attn if family == "dflash" else model.midlayer.self_attn)
    expected = {"eagle3": "MLAttention", "p_eagle": "Attention", "dflash": "DFlashAttention"}
    assert attention.__name__ == expected[family]
    if family == "dflash":
        assert model.config.rope_scaling == {"rope_type": "yarn", **{
            k: v for k, v in YARN.items() if k != "type"}}  # fmt: skip
        assert model.config.rope_theta == 50000.0
        assert model.config.max_position_embeddings == TINY_DEEPSEEK_V3["max_position_embeddings"]
