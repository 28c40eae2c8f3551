"""A target whose language model sits inside a multimodal wrapper (Kimi-K2.5's layout:
`KimiK25ForConditionalGeneration`, the DeepSeek-V3 text model as `text_config`, its tensors under
`language_model.` beside a vision tower) loads in transformers where the pipeline loads the target
(eaglenest.target_model.loading.load_target: hidden.backend transformers, hidden.verify_samples,
evaluate.live), and gives the logits and hidden states of the same text model unwrapped; the
transformers backend of the hidden stage writes the same shard from either."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.kimi_shape import TINY_DEEPSEEK_V3, build_kimi_shaped_target, write_tokens
from support.tiny_tokenizer import make_tokenizer

from eaglenest.common.config import settings_from_sections
from eaglenest.formats.hidden_shard import open_hidden_shard
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.stages.hidden_states.extract import extract_hidden_states
from eaglenest.target_model.loading import load_target

IDS = [[5, 17, 3, 40, 9, 11, 2, 30, 31, 7]]


@pytest.fixture(scope="module")
def wrapped_and_plain(tmp_path_factory) -> tuple[Path, Path]:
    """The same tiny random DeepSeek-V3 twice: in Kimi-K2.5's layout, and as a plain
    DeepseekV3ForCausalLM checkpoint with the same tokenizer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    root = tmp_path_factory.mktemp("wrapped")
    tokenizer_dir = make_tokenizer(root / "tokenizer")
    wrapped, plain = root / "kimi", root / "plain"
    state = build_kimi_shaped_target(wrapped, tokenizer_dir)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY_DEEPSEEK_V3, tie_word_embeddings=False))
    model.load_state_dict(state)
    model.save_pretrained(plain)
    return wrapped, plain


def test_a_kimi_k25_layout_target_loads_as_its_text_model(wrapped_and_plain):
    wrapped_dir, plain_dir = wrapped_and_plain
    wrapped = load_target(wrapped_dir, device="cpu", model_dtype="float32")
    plain = load_target(plain_dir, device="cpu", model_dtype="float32")
    assert type(wrapped).__name__ == "DeepseekV3ForCausalLM"
    ids = torch.tensor(IDS)
    with torch.inference_mode():
        a = wrapped(input_ids=ids, output_hidden_states=True)
        b = plain(input_ids=ids, output_hidden_states=True)
    assert torch.equal(a.logits, b.logits)
    assert len(a.hidden_states) == len(b.hidden_states) == TINY_DEEPSEEK_V3["num_hidden_layers"] + 1
    for mine, theirs in zip(a.hidden_states, b.hidden_states, strict=True):
        assert torch.equal(mine, theirs)
    # The vision tower's tensors were not read into it: the weights are the text model's alone.
    assert wrapped.state_dict().keys() == plain.state_dict().keys()


def test_the_transformers_backend_writes_the_same_states_from_either_layout(
    wrapped_and_plain, tmp_path
):
    tokens = write_tokens(tmp_path / "tokens.parquet", [6, 10])
    shards = {}
    for name, target in zip(("wrapped", "plain"), wrapped_and_plain, strict=True):
        settings = settings_from_sections(
            HiddenSettings,
            hidden={"dtype": "fp32", "model_dtype": "float32", "device": "cpu"},
            target={"path": str(target)},
        )
        shards[name] = tmp_path / f"{name}.safetensors"
        extract_hidden_states(tokens=tokens, out=shards[name], settings=settings)
    wrapped, plain = (open_hidden_shard(shards[n]) for n in ("wrapped", "plain"))
    assert len(wrapped) == len(plain) == 2
    for i in range(2):
        for name, tensor in plain.sample(i).items():
            assert torch.equal(wrapped.sample(i)[name], tensor), name
