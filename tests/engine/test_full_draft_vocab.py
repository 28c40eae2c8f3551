"""A draft vocabulary as large as the target's vocabulary is served by vLLM.

With `tokenize.draft_vocab_size` (default 32,000) at or above the target's vocabulary, the vocab
stage takes the whole vocabulary. The export once still wrote `d2t`, and vLLM refused the drafter
(`There is no module or parameter named 'draft_id_to_target_id'`: llama_eagle3.py and
deepseek_eagle3.py create it only when draft_vocab_size != vocab_size). Real targets with a
32,000-token vocabulary (Llama-2, Mistral-7B-v0.1) hit it with the defaults. Now such a drafter
ships no d2t/t2d and `draft_vocab_size == vocab_size`; training and own evaluation keep the
identity mapping.

The drafter here is made by the pipeline's own functions (the vocab stage over counts of the
demo target's vocabulary, the target head, the training's initialisation, the export), then
decoded by the real vLLM CPU build: speculative output equal to plain greedy output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from support.vllm import EAGER, VLLM_PYTHON, require_vllm_venv

from eaglenest.common.config import settings_from_sections
from eaglenest.drafter.eagle3.export import export_drafter, load_drafter
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.formats.target_head import TargetHead, save_target_head
from eaglenest.formats.token_counts import TokenCounts, write_token_counts
from eaglenest.settings.hidden_states import TargetHeadSettings
from eaglenest.settings.train import TrainSettings
from eaglenest.settings.vocab import VocabSettings
from eaglenest.stages.train.initialise import build_drafter
from eaglenest.stages.vocab import build_draft_vocab
from eaglenest.target_model.loading import load_text_config

PROMPTS = ("What is 12 + 7?", "What is 3 * 4?", "Sort 5, 2, 9.")


def full_vocab_drafter(target_dir: Path, work: Path) -> tuple[Path, Path]:
    """The export of a drafter whose draft vocabulary is the whole target vocabulary (the default
    draft_vocab_size, above the demo's), and the target head it was made with."""
    target = {"path": str(target_dir)}
    head_path = work / "target_head.safetensors"
    save_target_head(head_path, settings_from_sections(TargetHeadSettings, target=target))
    head = TargetHead.load(head_path)
    vocab_size = head.embed.shape[0]
    counts = np.random.default_rng(0).integers(0, 50, vocab_size).astype(np.int64)
    write_token_counts(work / "counts.safetensors", TokenCounts(counts, np.array([], np.int64)))
    vocab_path = work / "draft_vocab.safetensors"
    settings = settings_from_sections(VocabSettings)  # tokenize.draft_vocab_size: 32,000
    assert settings.draft_vocab_size > vocab_size
    build_draft_vocab([work / "counts.safetensors"], vocab_path, work / "vocab.json", settings)
    vocab = DraftVocab.load(vocab_path)
    # The identity mapping, as training and own evaluation read it.
    assert torch.equal(vocab.draft_ids, torch.arange(vocab_size))
    assert torch.equal(vocab.target_to_draft, torch.arange(vocab_size))
    train = settings_from_sections(TrainSettings, target=target, train={"export_dtype": "float32"})
    model = build_drafter(load_text_config(target["path"], False), head, vocab, train)
    export_drafter(model, work / "drafter", dtype="float32")
    return work / "drafter", head_path


def test_a_full_draft_vocabulary_exports_without_d2t_and_loads_back(demo_target_dir, tmp_path):
    drafter_dir, head_path = full_vocab_drafter(demo_target_dir, tmp_path)
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["draft_vocab_size"] == config["vocab_size"]
    with safe_open(str(drafter_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names and not names & {"d2t", "t2d"}, names
    head = TargetHead.load(head_path)
    model = load_drafter(drafter_dir, head.embed, expect_layer_ids=head.aux_layer_ids)
    assert not model.d2t.any() and model.t2d.all()
    assert torch.equal(model.draft_to_target(torch.arange(5)), torch.arange(5))


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_decodes_with_a_full_vocabulary_drafter_as_plain_greedy(demo_target_dir, tmp_path):
    from transformers import AutoTokenizer

    from eaglenest.settings.vllm import VllmEngine, VllmRuntime
    from eaglenest.stages.evaluate.vllm_evaluate import evaluate_in_vllm

    require_vllm_venv()
    drafter_dir, _ = full_vocab_drafter(demo_target_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(demo_target_dir)
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, return_dict=False))
        for text in PROMPTS
    ]  # fmt: skip
    engine = evaluate_in_vllm(
        prompts=prompts, drafter_dir=drafter_dir, target_path=demo_target_dir, ks=(3,),
        max_new_tokens=48, model_dtype="float32",
        engine=settings_from_sections(VllmEngine,
                                      vllm={"engine_args": {**EAGER, "max_num_seqs": 1}}),
        runtime=settings_from_sections(VllmRuntime, vllm={"python": VLLM_PYTHON}),
    )  # fmt: skip
    vllm = engine["per_k"]["3"]
    assert vllm["identical_to_plain"], engine
    assert vllm["tokens"] == engine["plain"]["tokens"] > 0
    assert vllm["rounds"] > 0
