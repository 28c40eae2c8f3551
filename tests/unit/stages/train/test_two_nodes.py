"""Training over several nodes (`train.nodes`): two torchrun agents on this machine, each as one
node with one process, meeting at a c10d rendezvous on 127.0.0.1 (gloo), train exactly as one
agent running two processes (`train.gpus` 2, the one-node path): the same loss trace step by step
and the same exported tensors. On hidden-state shards of random features in the stage's format
(as bench/train.py writes them), so the test needs no finished run."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.servers import free_port

from eaglenest.common.config import settings_from_sections
from eaglenest.formats.hidden_shard import FORMAT
from eaglenest.settings.train import TrainSettings
from eaglenest.stages.train.distributed import (
    run_under_torchrun,
    torchrun_command,
    write_torchrun_args,
)

pytestmark = pytest.mark.slow

SECTION = {"max_steps": 6, "max_batch_tokens": 256, "ttt_steps": 2, "warmup_steps": 0,
           "log_every": 1, "export_dtype": "float32", "device": "cpu"}  # fmt: skip


HIDDEN, VOCAB, DRAFT_VOCAB, LAYERS = 64, 512, 128, 8


def write_run(root: Path, seed: int = 0) -> Path:
    """A target config, its head, a draft vocabulary and two hidden-state shards of random
    features (one trained on, one held out), in the stages' formats."""
    from transformers import Qwen3Config

    rng = np.random.default_rng(seed)
    layer_ids = [2, LAYERS // 2, LAYERS - 3]
    Qwen3Config(hidden_size=HIDDEN, intermediate_size=192, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, num_hidden_layers=LAYERS,
                vocab_size=VOCAB).save_pretrained(root / "target")  # fmt: skip
    common = {"format": FORMAT, "aux_layer_ids": json.dumps(layer_ids), "hidden_size": str(HIDDEN)}
    head = {"embed_tokens.weight": torch.randn(VOCAB, HIDDEN) * 0.02,
            "lm_head.weight": torch.randn(VOCAB, HIDDEN) * 0.02}  # fmt: skip
    save_file(head, str(root / "head.safetensors"), metadata={**common, "vocab_size": str(VOCAB)})
    draft = np.sort(rng.choice(VOCAB, DRAFT_VOCAB, replace=False))
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.from_numpy(draft)] = True
    vocab = {"d2t": torch.from_numpy(draft - np.arange(DRAFT_VOCAB)), "t2d": t2d}
    save_file(vocab, str(root / "vocab.safetensors"))
    for shard in range(2):
        lengths = rng.integers(30, 90, 24)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        total = int(offsets[-1])
        mask = np.zeros(total, dtype=np.uint8)
        for begin, end in itertools.pairwise(offsets):
            mask[begin + (end - begin) // 4 : end] = 1  # the first quarter is the prompt
        tensors = {
            "aux": torch.randn(total, 3 * HIDDEN).to(torch.bfloat16),
            "final_hidden": torch.randn(total, HIDDEN).to(torch.bfloat16),
            "input_ids": torch.from_numpy(rng.integers(0, VOCAB, total)),
            "loss_mask": torch.from_numpy(mask),
            "offsets": torch.from_numpy(offsets.astype(np.int64)),
        }
        ids = json.dumps([f"{shard}-{i}" for i in range(len(lengths))])
        metadata = {**common, "dtype": "bf16", "target_signal": "final_hidden", "sample_ids": ids}
        save_file(tensors, str(root / f"{shard:05d}.safetensors"), metadata=metadata)
    return root


def arguments(run: Path, out: Path) -> dict:
    return {
        "train_shards": [str(run / "00000.safetensors")],
        "eval_shards": [str(run / "00001.safetensors")],
        "target_head": str(run / "head.safetensors"),
        "draft_vocab": str(run / "vocab.safetensors"),
        "out_dir": str(out / "drafter"),
        "journal_dir": str(out / "journal"),
    }


def settings(run: Path, **train) -> TrainSettings:
    return settings_from_sections(
        TrainSettings, train={**SECTION, **train}, target={"path": str(run / "target")}
    )


def loss_trace(out: Path) -> list[tuple[int, float]]:
    lines = (out / "drafter" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [(r["step"], r["loss"]) for r in records if r.get("split", "train") == "train"
            and "loss" in r]  # fmt: skip


def test_two_agents_as_two_nodes_train_as_one_agent_with_two_processes(tmp_path):
    results = write_run(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    one = tmp_path / "one-node"
    started = time.monotonic()
    run_under_torchrun(
        settings(results, gpus=2), arguments(results, one), str(tmp_path / "one.log")
    )
    one_s = time.monotonic() - started

    two = tmp_path / "two-nodes"
    two_nodes = settings(results, gpus=1, nodes=2)
    args_file = write_torchrun_args(two_nodes, arguments(results, two))
    command = torchrun_command(two_nodes, args_file, f"127.0.0.1:{free_port()}", "two-node-test")
    assert "--standalone" not in command and "--nnodes=2" in command
    started = time.monotonic()
    agents = []
    for node in range(2):
        log = open(tmp_path / f"agent{node}.log", "w")  # noqa: SIM115 (closed below)
        agents.append((subprocess.Popen(command, stdout=log, stderr=log, env=env), log))
    for agent, log in agents:
        assert agent.wait(timeout=900) == 0, (tmp_path / "agent0.log").read_text()[-3000:]
        log.close()
    two_s = time.monotonic() - started

    reports = [
        json.loads((out / "drafter" / "train_report.json").read_text()) for out in (one, two)
    ]
    assert [r["world_size"] for r in reports] == [2, 2] and [r["steps"] for r in reports] == [6, 6]
    trace_one, trace_two = loss_trace(one), loss_trace(two)
    assert [s for s, _ in trace_one] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in trace_two] == [s for s, _ in trace_one]
    for (_, a), (_, b) in zip(trace_one, trace_two, strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    weights = [load_file(out / "drafter" / "model.safetensors") for out in (one, two)]
    assert weights[0].keys() == weights[1].keys()
    worst = 0.0
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=1e-5, atol=1e-6)
        worst = max(worst, float((weights[1][name].double() - tensor.double()).abs().max()))
    print(
        f"two agents (2 nodes x 1 process) vs one agent (2 processes): {len(trace_one)} steps, "
        f"losses {[round(x, 4) for _, x in trace_one]} vs {[round(x, 4) for _, x in trace_two]}, "
        f"largest weight difference {worst:.2e}; {two_s:.1f} s vs {one_s:.1f} s"
    )
