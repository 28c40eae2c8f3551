"""A target with Kimi-K2.5's shape (tests/support/kimi_shape.py: the language model's config
nested as `text_config` of a KimiK25ForConditionalGeneration config, its tensors under
`language_model.` beside a vision tower) through every stage that reads the target's config or
checkpoint without running it: validation's vocabulary bound, tokenize, the draft vocabulary, the
target head, the drafter's sizes, and the hidden stage's planning. tests/workflow/test_examples.py plans Kimi-K2.5's own
sizes (61 layers: aux (2, 30, 58), H = 7168) from such a config.json."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.frames import sample, samples_frame
from support.kimi_shape import TINY_DEEPSEEK_V3, build_kimi_shaped_target
from support.tiny_tokenizer import THINK_END, THINK_START, make_tokenizer

from eaglenest.common.config import settings_from_sections, validate_config
from eaglenest.common.io import write_json
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.formats.target_head import TargetHead, save_target_head
from eaglenest.formats.token_counts import read_token_counts
from eaglenest.settings.hidden_states import HiddenSettings, TargetHeadSettings
from eaglenest.settings.samples import TokenizeSettings
from eaglenest.settings.target import TargetSettings
from eaglenest.settings.train import TrainSettings
from eaglenest.settings.vocab import VocabSettings
from eaglenest.stages.hidden_states.plan import plan_hidden_shard
from eaglenest.stages.samples.tokenize import tokenize_shard
from eaglenest.stages.train.initialise import build_drafter
from eaglenest.stages.vocab import build_draft_vocab
from eaglenest.target_model.loading import load_text_config
from eaglenest.target_model.tokenizer import load_tokenizer, target_vocab_size_of


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("kimi-shaped")
    tokenizer_dir = make_tokenizer(root / "tokenizer")
    target = root / "target"
    return target, build_kimi_shaped_target(target, tokenizer_dir)


def kimi_config(target: Path) -> dict:
    """As the Kimi-K2.5 example configures its target (think ids in config, `thinking`)."""
    tokenizer = load_tokenizer(settings_from_sections(TargetSettings, target={"path": str(target)}))
    start_id, end_id = tokenizer.convert_tokens_to_ids([THINK_START, THINK_END])
    return validate_config(
        {
            "target": {
                "path": str(target),
                "chat_template_kwargs": {"thinking": True},
                "think_tokens": {"start_id": start_id, "end_id": end_id},
            },
            "tokenize": {"draft_vocab_size": 16},
        }
    )


def tokenized_shard(target: Path, config: dict, tmp_path: Path) -> tuple[Path, Path]:
    """Samples through the tokenize stage (think ids as the probe records them from config)."""
    rows = [
        sample("What is 2 + 2?", "\nFirst add the units: 2 + 2 = 4.\n", "\n\nThe answer is 4."),
        sample("Count the letters in banana.", "\n6 letters\n", "\n\n**6**"),
    ]
    samples_frame(rows).write_parquet(tmp_path / "samples.parquet")
    think = config["target"]["think_tokens"] | {"source": "config"}
    write_json(tmp_path / "probe.json", {"think_token_ids": think})
    paths = {name: tmp_path / name for name in ("tokens.parquet", "counts.safetensors")}
    tokenize_shard(
        samples=tmp_path / "samples.parquet",
        probe=tmp_path / "probe.json",
        tokens_out=paths["tokens.parquet"],
        counts_out=paths["counts.safetensors"],
        report_out=tmp_path / "report.json",
        settings=TokenizeSettings.from_config(config),
        shard="00000",
    )
    return paths["tokens.parquet"], paths["counts.safetensors"]


def test_kimi_shaped_target_through_the_stages_that_read_it(kimi_dir, tmp_path):
    target, state = kimi_dir
    config = kimi_config(target)
    vocab_size = TINY_DEEPSEEK_V3["vocab_size"]  # text_config's, above the tokenizer's length
    assert len(load_tokenizer(TargetSettings.from_config(config))) < vocab_size
    bound = target_vocab_size_of(TargetSettings.from_config(config))  # validation's id bound
    assert bound == vocab_size

    tokens, counts = tokenized_shard(target, config, tmp_path)
    assert read_token_counts(counts).target_vocab_size == vocab_size
    summary = build_draft_vocab(
        [counts], tmp_path / "vocab.safetensors", tmp_path / "v.json", VocabSettings(16)
    )
    assert summary["target_vocab_size"] == vocab_size
    vocab = DraftVocab.load(tmp_path / "vocab.safetensors")
    assert vocab.t2d.shape == (vocab_size,)

    metadata = save_target_head(
        tmp_path / "head.safetensors", TargetHeadSettings.from_config(config)
    )
    assert (metadata["hidden_size"], metadata["vocab_size"]) == ("64", str(vocab_size))
    assert metadata["aux_layer_ids"] == "[2, 4, 5]"  # (2, N//2, N-3) of text_config's 8 layers
    assert metadata["tied_word_embeddings"] == "false"  # the text model's, not the wrapper's
    head = TargetHead.load(tmp_path / "head.safetensors")
    assert torch.equal(head.embed, state["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head, state["lm_head.weight"])
    assert torch.equal(head.final_norm, state["model.norm.weight"])  # not the vision tower's

    drafter = build_drafter(
        load_text_config(target), head, vocab, TrainSettings.from_config(config)
    )
    assert (drafter.config.target_hidden_size, drafter.config.vocab_size) == (64, vocab_size)
    assert tuple(drafter.config.aux_layer_ids) == (2, 4, 5)

    settings = HiddenSettings.from_config(config)
    plan = plan_hidden_shard(tokens, load_text_config(target), settings)
    assert (plan.layer_ids, plan.hidden_size) == ((2, 4, 5), 64)
    assert {name: shape for name, _, shape in plan.specs}["aux"] == [plan.n_tokens, 3 * 64]


def test_the_vllm_backends_top1_signal_from_kimis_language_model_tensors(kimi_dir):
    """The vLLM backend's signal (FinalSignal) reads the final norm and the untied LM head
    under `language_model.` (never the vision tower's norm) and keeps the target's top-1 token
    of each row, as the examples store it."""
    from eaglenest.stages.hidden_states.vllm_backend import FinalSignal

    target, state = kimi_dir
    config = validate_config({"hidden": {"dtype": "fp8", "target_signal": "topk", "top_k": 1}})
    settings = HiddenSettings.from_config(config)
    signal = FinalSignal(target, load_text_config(target), settings)
    last_layer = torch.randn(
        5, TINY_DEEPSEEK_V3["hidden_size"], generator=torch.Generator().manual_seed(0)
    )
    got = signal(last_layer)
    assert set(got) == {"topk_ids", "topk_values"} and got["topk_ids"].shape == (5, 1)
    h = last_layer.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * state["model.norm.weight"]
    expected = (normed @ state["lm_head.weight"].T).argmax(-1)
    assert got["topk_ids"][:, 0].tolist() == expected.tolist()
