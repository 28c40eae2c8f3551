"""A training run's inputs of random features, in the stages' formats: a target config, its head
(embedding and LM head), a draft vocabulary and hidden-state shards (the tensors and metadata the
hidden-state stage writes, bf16, the final hidden state as target signal), so that training runs
as the pipeline runs it without a finished run. For tests (tests/unit/stages/train/
test_two_nodes.py) and benches (bench/train.py, bench/gpu_check.py), which put tests/ on
sys.path first."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from eaglenest.formats.hidden_shard import FORMAT

# The demo's sizes (the benches' CPU size: bench/train.py, bench/families.py).
DEMO_SIZE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 8,
    "vocab_size": 1024,
    "draft_vocab_size": 256,
    "lengths": (40, 120),
    "max_batch_tokens": 2048,
}


def write_synthetic_run(root: Path, size: dict, samples: int, shards: int, seed: int = 0) -> dict:
    """The run at `root` (created): a Qwen3 target config of `size` (hidden_size,
    intermediate_size, num_attention_heads, num_key_value_heads, head_dim, num_hidden_layers,
    vocab_size), a draft vocabulary of `size["draft_vocab_size"]`, and `shards` shards of
    `samples // shards` samples each of `size["lengths"]` (low, high) tokens, the first quarter
    of each its prompt. Returns train_drafter's file arguments (every shard trained on) and
    `target_path`."""
    from transformers import Qwen3Config

    rng = np.random.default_rng(seed)
    h, v, d = size["hidden_size"], size["vocab_size"], size["draft_vocab_size"]
    layers = size["num_hidden_layers"]
    layer_ids = [2, layers // 2, layers - 3]
    Qwen3Config(
        hidden_size=h,
        intermediate_size=size["intermediate_size"],
        num_attention_heads=size["num_attention_heads"],
        num_key_value_heads=size["num_key_value_heads"],
        head_dim=size["head_dim"],
        num_hidden_layers=layers,
        vocab_size=v,
    ).save_pretrained(root / "target")
    common = {"format": FORMAT, "aux_layer_ids": json.dumps(layer_ids), "hidden_size": str(h)}
    embed = torch.randn(v, h) * 0.02
    save_file(
        {"embed_tokens.weight": embed, "lm_head.weight": torch.randn(v, h) * 0.02},
        str(root / "head.safetensors"),
        metadata={**common, "vocab_size": str(v)},
    )
    draft = np.sort(rng.choice(v, d, replace=False))
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[torch.from_numpy(draft)] = True
    save_file(
        {"d2t": torch.from_numpy(draft - np.arange(d)), "t2d": t2d},
        str(root / "vocab.safetensors"),
    )
    paths = []
    per_shard = samples // shards
    for s in range(shards):
        lengths = rng.integers(*size["lengths"], per_shard)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        total = int(offsets[-1])
        mask = np.zeros(total, dtype=np.uint8)
        for begin, end in itertools.pairwise(offsets):
            mask[begin + (end - begin) // 4 : end] = 1  # the first quarter is the prompt
        tensors = {
            "aux": torch.randn(total, 3 * h).to(torch.bfloat16),
            "final_hidden": torch.randn(total, h).to(torch.bfloat16),
            "input_ids": torch.from_numpy(rng.integers(0, v, total)),
            "loss_mask": torch.from_numpy(mask),
            "offsets": torch.from_numpy(offsets.astype(np.int64)),
        }
        metadata = {
            **common,
            "dtype": "bf16",
            "target_signal": "final_hidden",
            "sample_ids": json.dumps([f"{s}-{i}" for i in range(per_shard)]),
        }
        path = root / f"{s:05d}.safetensors"
        save_file(tensors, str(path), metadata=metadata)
        paths.append(str(path))
    return {
        "train_shards": paths,
        "eval_shards": [],
        "target_head": str(root / "head.safetensors"),
        "draft_vocab": str(root / "vocab.safetensors"),
        "target_path": str(root / "target"),
    }
