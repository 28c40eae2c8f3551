"""Training over several nodes (`train.nodes`): two torchrun agents on this machine, each as one
node with one process, meeting at a c10d rendezvous on 127.0.0.1 (gloo), train exactly as one
agent running two processes (`train.gpus` 2, the one-node path): the same loss trace step by step
and the same exported tensors. On hidden-state shards of random features in the stage's format
(support/synthetic_run.py, as bench/train.py writes them), so the test needs no finished run."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.servers import free_port
from support.synthetic_run import write_synthetic_run

from eaglenest.common.config import settings_from_sections
from eaglenest.settings.train import TrainSettings
from eaglenest.stages.train.distributed import (
    run_under_torchrun,
    torchrun_command,
    write_torchrun_args,
)

pytestmark = pytest.mark.slow

SECTION = {"max_steps": 6, "max_batch_tokens": 256, "ttt_steps": 2, "warmup_steps": 0,
           "log_every": 1, "export_dtype": "float32", "device": "cpu"}  # fmt: skip


# Two shards of 24 samples: one trained on, one held out.
SIZE = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "num_hidden_layers": 8,
    "vocab_size": 512,
    "draft_vocab_size": 128,
    "lengths": (30, 90),
}


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
    results = tmp_path / "run"
    write_synthetic_run(results, SIZE, samples=48, shards=2)
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


def test_a_group_that_fails_raises_with_the_end_of_its_log(tmp_path):
    """A process of the group that dies gives an error naming the log and holding its end (the
    processes' own traceback), not a bare exit status with the reason left in a file."""
    results = tmp_path / "run"
    write_synthetic_run(results, SIZE, samples=8, shards=2)
    (results / "00000.safetensors").write_bytes(b"not a safetensors file")
    log = tmp_path / "group.log"
    with pytest.raises(RuntimeError, match="torchrun exited with 1") as failed:
        run_under_torchrun(settings(results, gpus=2), arguments(results, tmp_path), str(log))
    message = str(failed.value)
    assert str(log) in message and "00000.safetensors" in message
    assert message.splitlines()[-1] in log.read_text()


def test_the_error_of_a_group_leaves_out_the_agents_traceback_alone():
    """Only the traceback that ends in the agent's ChildFailedError goes: a process's own
    traceback printed without torch's prefix stays, and so does the summary after it."""
    from eaglenest.stages.train.distributed import group_failure

    log = """step 4
Traceback (most recent call last):
  File "worker.py", line 3, in <module>
ValueError: the process's own error
Traceback (most recent call last):
  File "torch/distributed/run.py", line 1032, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
  exitcode  : -6 (pid: 30256)  (SIGABRT)
"""
    kept = group_failure(log)
    assert "ValueError: the process's own error" in kept and "SIGABRT" in kept
    assert "torch/distributed/run.py" not in kept and "ChildFailedError" not in kept
    assert group_failure("Traceback (most recent call last):\nboom") == (
        "Traceback (most recent call last):\nboom"  # no agent failure: everything stays
    )
