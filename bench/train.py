"""Training benchmark: tokens/s of drafter training and the share of time spent waiting for data.

Hidden-state shards of random features are written in the stage's format (same tensors and
metadata as the hidden-state stage writes: tests/support/synthetic_run.py), then `train_drafter`
runs on them as the pipeline does: memory-mapped reads, batches built in a prefetch thread, the
target's logits from the stored final hidden state, TTT with 7 steps. Figures:
- tokens/s of the stage (padded batch tokens per second of the training loop),
- data-wait share: time the loop waited for a batch / loop time (goal < 10%),
- a bare loop (the same batches already in memory, no loader): the stage's ratio to it.

CPU: the demo's sizes (H 128, vocab 1024, draft 256). On a CUDA GPU (when present, or
`--device cuda`): a drafter of Llama-3-8B size (H 4096, 32 heads, 8 kv heads, MLP 14336, vocab
128256, draft 32000) with bf16 autocast, and its model FLOPs utilisation against `--peak-tflops`
(default: 989, H100/H200 dense bf16).

`--long-context`: peak memory and tokens/s of one 7-step TTT training step (forward, loss,
backward) on one sample of T = 2K, 8K, 16K and 32K tokens (`--lengths`), each T in a fresh
process: H 256, 4 heads on CPU (peak resident memory over the step), Llama-8B sizes on CUDA (peak
allocated). One line per T, `long-context T=<T> peak_mib=<M> tokens_per_s=<R>`, then the ratio of
peak memory at 32K to 8K. Goal: memory linear in T (ratio <= 4.5; a [T, T] block kept per step
would make it ~16).

Usage: python bench/train.py [--quick] [--device cpu|cuda] [--steps N] [--json out.json]
       python bench/train.py --long-context [--lengths 2048 8192 ...] [--activation-checkpointing]
                             [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.synthetic_run import DEMO_SIZE, write_synthetic_run

from eaglenest.drafter.batches import (
    Batch,
    BatchPlan,
    TargetSignal,
    build_batch,
    open_shards,
)
from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.eagle3.model import Eagle3Drafter, ttt_forward
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.formats.target_head import TargetHead
from eaglenest.settings.train import TrainSettings
from eaglenest.stages.train.initialise import build_drafter
from eaglenest.stages.train.loss import ttt_loss
from eaglenest.stages.train.train import train_drafter

SIZES = {
    "demo": DEMO_SIZE,
    "llama-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
        "draft_vocab_size": 32000,
        "lengths": (1024, 4096),
        "max_batch_tokens": 16384,
    },
}


def bare_loop(run: dict, settings: TrainSettings, steps: int, device: str) -> float:
    """Tokens/s of the same training steps on batches already in memory (no loader)."""
    from transformers import AutoConfig

    head, vocab = TargetHead.load(run["target_head"]), DraftVocab.load(run["draft_vocab"])
    shards = open_shards(run["train_shards"], head, vocab)
    signal = TargetSignal(head, vocab, device)
    model = build_drafter(AutoConfig.from_pretrained(run["target_path"]), head, vocab, settings)
    model = model.to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    order = BatchPlan(shards, settings.max_batch_tokens, settings.seed).epoch_order(0)
    # In memory before the clock starts; the target's logits are computed in the loop, as the
    # stage does on the training device.
    batches = [build_batch(refs, shards).to(device) for refs in order[:steps]]
    bf16 = device.startswith("cuda")
    tokens = 0
    synchronize(device)
    started = time.perf_counter()
    for batch in batches:
        batch = signal.fill(batch)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=bf16):
            logits = ttt_forward(model, batch.aux, batch.input_ids, settings.ttt_steps)
        loss, _ = ttt_loss(logits, batch, settings.step_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch.n_tokens
    synchronize(device)
    return tokens / (time.perf_counter() - started)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def flops_per_token(size: dict, ttt_steps: int, mean_length: float) -> float:
    """Training FLOPs per token (forward x 3) of the drafter: its matmuls and attention."""
    h, i, d = size["hidden_size"], size["intermediate_size"], size["draft_vocab_size"]
    heads, kv, hd = size["num_attention_heads"], size["num_key_value_heads"], size["head_dim"]
    per_step = 2 * (2 * h * heads * hd + 2 * 2 * h * kv * hd + heads * hd * h + 3 * h * i + h * d)
    attention = 2 * 2 * heads * hd * (mean_length / 2)  # causal scores and values per query
    return 3 * (2 * 3 * h * h + ttt_steps * (per_step + attention))


LONG_CONTEXT_LENGTHS = (2048, 8192, 16384, 32768)
LONG_CONTEXT_SIZES = {
    "cpu": {"hidden": 256, "heads": 4, "kv_heads": 4, "mlp": 768, "vocab": 4096, "draft": 1024},
    "cuda": {"hidden": 4096, "heads": 32, "kv_heads": 8, "mlp": 14336, "vocab": 128256,
             "draft": 32000},
}  # fmt: skip


def resident_mib() -> float:
    with open("/proc/self/statm") as stream:
        return int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def long_context_step(
    length: int, device: str, checkpointed: bool = False, sliding_window: int | None = None
) -> dict:
    """One TTT training step on one sample of `length` tokens, in this (fresh) process; the
    drafter's attention within `sliding_window` positions when given (bench/drafter_window.py)."""
    s = LONG_CONTEXT_SIZES["cuda" if device.startswith("cuda") else "cpu"]
    config = DrafterConfig(
        hidden_size=s["hidden"], target_hidden_size=s["hidden"], intermediate_size=s["mlp"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["hidden"] // s["heads"], vocab_size=s["vocab"], draft_vocab_size=s["draft"],
        aux_layer_ids=(2, 4, 6), max_position_embeddings=length + 8, sliding_window=sliding_window,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Eagle3Drafter(config).to(device).train()
    model.checkpoint_layer = checkpointed
    aux = torch.randn(1, length, 3 * s["hidden"], device=device)
    ids = torch.randint(0, s["vocab"], (1, length), device=device)
    mask = torch.ones(1, length, dtype=torch.bool, device=device)
    target = torch.randn(1, length, s["draft"], device=device)
    batch = Batch(aux, ids, mask, target, mask, [])
    gpu = device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = resident_mib()
    started = time.perf_counter()
    with autocast:
        loss, _ = ttt_loss(ttt_forward(model, aux, ids, 7), batch, 0.8)
    loss.backward()
    synchronize(device)
    seconds = time.perf_counter() - started
    if gpu:
        peak = torch.cuda.max_memory_allocated() / 2**20 - before
    else:  # ru_maxrss is in KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    return {"T": length, "peak_mib": peak, "tokens_per_s": length / seconds, "seconds": seconds}


def long_context(args) -> dict:
    rows = []
    for length in args.lengths:
        command = [sys.executable, __file__, "--long-context-one", str(length),
                   "--device", args.device, "--threads", str(args.threads)]  # fmt: skip
        if args.activation_checkpointing:
            command.append("--activation-checkpointing")
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"long-context T={row['T']} peak_mib={row['peak_mib']:.0f} "
              f"tokens_per_s={row['tokens_per_s']:.0f}", flush=True)  # fmt: skip
    by_t = {row["T"]: row["peak_mib"] for row in rows}
    results = {"device": args.device, "rows": rows,
               "activation_checkpointing": args.activation_checkpointing}  # fmt: skip
    if 32768 in by_t and 8192 in by_t:
        results["peak_ratio_32k_to_8k"] = by_t[32768] / by_t[8192]
        print(f"long-context peak memory 32K / 8K = {results['peak_ratio_32k_to_8k']:.2f} "
              "(goal <= 4.5: linear in T)")  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long-context", action="store_true")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LONG_CONTEXT_LENGTHS))
    parser.add_argument("--long-context-one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Here, not at the top: jsonschema is not on every GPU machine, and bench/gpu_check.py
    # imports this module's long-context step and synthetic run.
    from eaglenest.common.config import settings_from_sections

    if args.long_context_one:
        step = long_context_step(args.long_context_one, args.device, args.activation_checkpointing)
        print(json.dumps(step))
        return
    if args.long_context:
        results = long_context(args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
        return
    gpu = args.device.startswith("cuda")
    name = "llama-8b" if gpu else "demo"
    size = SIZES[name]
    steps = args.steps or (10 if args.quick else (40 if gpu else 60))
    # Enough samples for a few distinct batches; epochs repeat them (random features either way).
    distinct_batches = 4 if gpu else 20
    mean_length = int(np.mean(size["lengths"]))
    samples = max(8, distinct_batches * size["max_batch_tokens"] // mean_length)
    settings = settings_from_sections(
        TrainSettings,
        train={
            "max_steps": steps,
            "epochs": 1000,
            "max_batch_tokens": size["max_batch_tokens"],
            "warmup_steps": 0,
            "checkpoint_every": 10**9,
            "log_every": 10**9,
            "device": args.device,
            "export_dtype": "bfloat16",
        },
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = write_synthetic_run(root, size, samples=samples, shards=2)
        arguments = {k: v for k, v in run.items() if k != "target_path"}
        report = train_drafter(
            **arguments,
            out_dir=root / "drafter",
            journal_dir=root / "journal",
            settings=settings.with_target_path(run["target_path"]),
        )
        bare = bare_loop(run, settings, min(steps, 20), args.device)
    stage = report["tokens_per_s"]
    results = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if gpu else platform.processor(),
        "sizes": name,
        "steps": report["steps"],
        "ttt_steps": settings.ttt_steps,
        "tokens_per_s": stage,
        "bare_tokens_per_s": bare,
        "ratio_to_bare": stage / bare,
        "data_wait_share": report["data_wait_share"],
        "data_wait_goal": 0.10,
        "threads": args.threads,
    }
    if gpu:
        flops = flops_per_token(size, settings.ttt_steps, float(np.mean(size["lengths"])))
        results["model_flops_per_token"] = flops
        results["mfu"] = stage * flops / (args.peak_tflops * 1e12)
        results["peak_tflops"] = args.peak_tflops
    print(f"training ({name} sizes, {args.device}, {settings.ttt_steps} TTT steps):")
    print(f"  stage        {stage:10.0f} tokens/s")
    print(f"  bare loop    {bare:10.0f} tokens/s   ratio {stage / bare:.3f}")
    print(f"  data wait    {report['data_wait_share']:.1%} of the loop (goal < 10%)")
    if gpu:
        print(f"  MFU          {results['mfu']:.1%} of {args.peak_tflops:.0f} TFLOP/s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
