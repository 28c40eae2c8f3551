"""`demo_target.layout: kimi_k25`: the demo target's build saves its DeepSeek-V3 model wrapped as
Kimi-K2.5 ships (eaglenest.demo.kimi_layout): the config nesting, the tensors' names and files,
what vLLM needs to serve that layout, and a chat template that switches on `thinking`; the pipeline
loads its text model as the model it wraps. tests/engine/test_kimi_k25_layout.py serves the
trained one in vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eaglenest.common.config import settings_from_sections
from eaglenest.demo.target import build_demo_target
from eaglenest.settings.demo_target import DemoTargetSettings

# A tiny DeepSeek-V3, trained two steps: the layout is under test, not the model.
TINY = {
    "architecture": "deepseek_v3",
    "num_layers": 4,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 400,
    "batch_size": 4,
    "train_steps": 2,
    "heldout_prompts": 2,
    "min_reasoning_share": 0,
    "deepseek_v3": {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 8, "moe_intermediate_size": 16,
                    "n_routed_experts": 4},
}  # fmt: skip


@pytest.fixture(scope="module")
def both_layouts(tmp_path_factory) -> tuple[Path, Path]:
    """The same build (same seed) saved plainly and in Kimi-K2.5's layout."""
    root = tmp_path_factory.mktemp("layouts")
    out = []
    for layout in ("plain", "kimi_k25"):
        settings = settings_from_sections(
            DemoTargetSettings, demo_target={**TINY, "layout": layout}
        )
        build_demo_target(root / layout, settings, threads=1)
        out.append(root / layout)
    return out[0], out[1]


def test_the_kimi_layout_is_kimi_k25s(both_layouts):
    plain, kimi = both_layouts
    config = json.loads((kimi / "config.json").read_text())
    text = json.loads((plain / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["model_type"] == "kimi_k25"
    assert config["text_config"]["model_type"] == "kimi_k2"
    assert config["text_config"]["kv_lora_rank"] == text["kv_lora_rank"]
    assert config["vision_config"]["num_hidden_layers"] == 1
    # What vLLM 0.32 needs to serve it and to load a drafter beside it (docs/vllm-cpu.md).
    assert "media_placeholder_token_id" in config
    assert "media_proc_cfg" in json.loads((kimi / "preprocessor_config.json").read_text())
    index = json.loads((kimi / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == {"model-00001-of-00002.safetensors",
                                   "model-00002-of-00002.safetensors"}  # fmt: skip
    assert "language_model.model.embed_tokens.weight" in index
    assert "language_model.lm_head.weight" in index
    assert any(name.startswith("vision_tower.") for name in index)
    assert not (kimi / "model.safetensors").exists()


def test_the_kimi_template_switches_on_thinking(both_layouts):
    from transformers import AutoTokenizer

    plain, kimi = both_layouts
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    tokenizer = AutoTokenizer.from_pretrained(kimi)
    assert len(tokenizer) == len(AutoTokenizer.from_pretrained(plain))  # the demo tokenizer
    render = lambda **kw: tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kw
    )
    assert render(thinking=True).endswith("<|im_start|>assistant\n<think>")
    assert render().endswith("<think>")  # on by default, as Kimi-K2.5's
    assert render(thinking=False).endswith("<think></think>")


def test_the_pipeline_loads_the_kimi_layout_as_its_text_model(both_layouts):
    from eaglenest.target_model.loading import load_target

    plain, kimi = (load_target(path, "cpu", "float32") for path in both_layouts)
    assert type(kimi) is type(plain)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        a, b = kimi(input_ids=ids), plain(input_ids=ids)
    assert torch.equal(a.logits, b.logits)


def test_the_kimi_layout_wraps_deepseek_v3_only(tmp_path):
    settings = settings_from_sections(
        DemoTargetSettings, demo_target={**TINY, "architecture": "qwen3", "layout": "kimi_k25"}
    )
    with pytest.raises(ValueError, match="demo_target.architecture deepseek_v3"):
        build_demo_target(tmp_path / "target", settings, threads=1)
    assert not (tmp_path / "target").exists()
