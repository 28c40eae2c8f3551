"""The serving device's timings the report's family choice counts in (report.device, read by
src/eaglenest/settings/report.py): on this device, one drafter forward over one target decode
step (`drafter_ratio`) and verifying K + 1 tokens in one target forward over one decode step
(`verify_cost`), at batch 1 and a few batch sizes. bench/gpu_check.py's device_timings step runs
it (a helper, `_`: bench/run_all.py runs no such file on its own); by hand:

    PYTHONPATH=src python bench/_device_timings.py [--device cuda] [--small] [--out PATH]

What is timed is a decoder of plain torch (RMSNorm, grouped-query attention by
scaled_dot_product_attention over a KV cache of `context` tokens, SwiGLU MLP) at a target's sizes
(`SHAPES`, Llama-3-8B's by default: the widths of a large dense target's layers; a user with
another target gives their own figures in report.device):
- the target's decode step: `target_layers` layers and its LM head over `width` new tokens a
  sequence (1: plain decoding; K + 1: verifying K drafts);
- the drafter's forward (EAGLE-3's, one a drafted token): its fc over three target layers'
  states, one layer, the norm and the draft vocabulary's head over one new token; and the same
  over K tokens (a parallel drafter's one forward: P-EAGLE's, DFlash's block) as
  `drafter_ratio_by_width`, for a family_ratios of the user's.

Every layer reuses one layer's weights and one KV cache (the time is a layer's whatever its
values: each reads its weights from memory all the same). On CUDA each forward is captured in a
CUDA graph and replayed, as serving engines run decode steps (eager Python launches would make
a one-token step look far slower than it is); on the CPU it runs eagerly (a dry run: the CPU's
figures say nothing of a GPU's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {
    # Llama-3-8B's layer (H 4096, 32 heads of 128, 8 KV heads, MLP 14336, vocabulary 128,256),
    # 32 target layers; a draft vocabulary of 32,000.
    "full": {"hidden": 4096, "heads": 32, "kv_heads": 8, "mlp": 14336, "vocab": 128256,
             "draft_vocab": 32000, "target_layers": 32, "context": 1024},
    "small": {"hidden": 64, "heads": 4, "kv_heads": 2, "mlp": 128, "vocab": 256,
              "draft_vocab": 64, "target_layers": 4, "context": 32},
}  # fmt: skip
BATCHES = {"full": (1, 8, 32), "small": (1, 2)}
# K of every family's defaults and references: EAGLE-3 / P-EAGLE 1-8, DFlash 7 (block 8) and 15.
KS = {"full": (1, 2, 3, 4, 5, 6, 7, 8, 15), "small": (1, 3)}
REPEATS = {"full": 20, "small": 3}


def layer_weights(shape: dict, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One decoder layer's weights, random (scaled so activations stay finite in bf16)."""
    hidden, head_dim = shape["hidden"], shape["hidden"] // shape["heads"]
    kv = shape["kv_heads"] * head_dim
    sizes = {"q": (hidden, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, hidden),
             "gate": (shape["mlp"], hidden), "up": (shape["mlp"], hidden),
             "down": (hidden, shape["mlp"])}  # fmt: skip
    generator = torch.Generator(device="cpu").manual_seed(0)
    return {
        name: (torch.randn(size, generator=generator) / size[1] ** 0.5).to(device, dtype)
        for name, size in sizes.items()
    }


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def decoder_layer(x: torch.Tensor, w: dict, cache: tuple[torch.Tensor, torch.Tensor], shape: dict):
    """x [B, width, H] through attention over the cache's CONTEXT tokens and x's own, and the
    MLP. The cache is read, not grown: each timed step starts from the same context."""
    batch, width, hidden = x.shape
    heads, kv_heads = shape["heads"], shape["kv_heads"]
    head_dim = hidden // heads
    h = rms_norm(x)
    q = (h @ w["q"].T).view(batch, width, heads, head_dim).transpose(1, 2)
    k = (h @ w["k"].T).view(batch, width, kv_heads, head_dim).transpose(1, 2)
    v = (h @ w["v"].T).view(batch, width, kv_heads, head_dim).transpose(1, 2)
    k = torch.cat([cache[0], k], dim=2).repeat_interleave(heads // kv_heads, dim=1)
    v = torch.cat([cache[1], v], dim=2).repeat_interleave(heads // kv_heads, dim=1)
    attended = F.scaled_dot_product_attention(q, k, v)
    x = x + attended.transpose(1, 2).reshape(batch, width, hidden) @ w["o"].T
    h = rms_norm(x)
    return x + (F.silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T


def timed(forward: Callable[[], Any], device: str, repeats: int) -> float:
    """The median seconds of `forward`: replays of its CUDA graph on CUDA, else eager calls."""
    if device.startswith("cuda"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up before the capture, as CUDA graphs ask
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        run = graph.replay
    else:
        forward()
        run = forward
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(device: str = "cuda", size: str = "full", deadline: float | None = None) -> dict:
    """The timings at every batch size of BATCHES[size] (stops early past `deadline`, a
    time.perf_counter(), keeping what it has)."""
    shape, repeats = SHAPES[size], REPEATS[size]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    hidden, head_dim = shape["hidden"], shape["hidden"] // shape["heads"]
    weights = layer_weights(shape, device, dtype)
    target_head = torch.randn(shape["vocab"], hidden, device=device, dtype=dtype) / hidden**0.5
    draft_head = target_head[: shape["draft_vocab"]].clone()
    fc = torch.randn(hidden, 3 * hidden, device=device, dtype=dtype) / (3 * hidden) ** 0.5
    by_batch: dict[str, Any] = {}
    for batch in BATCHES[size]:
        if deadline is not None and time.perf_counter() > deadline:
            break
        kv = (batch, shape["kv_heads"], shape["context"], head_dim)
        cache = (torch.randn(kv, device=device, dtype=dtype),) * 2

        def target(width: int, cache=cache, batch=batch) -> float:
            x = torch.randn(batch, width, hidden, device=device, dtype=dtype)

            def forward():
                h = x
                for _ in range(shape["target_layers"]):
                    h = decoder_layer(h, weights, cache, shape)
                return rms_norm(h) @ target_head.T

            return timed(forward, device, repeats)

        def drafter(width: int, cache=cache, batch=batch) -> float:
            states = torch.randn(batch, width, 3 * hidden, device=device, dtype=dtype)

            def forward():
                h = decoder_layer(states @ fc.T, weights, cache, shape)
                return rms_norm(h) @ draft_head.T

            return timed(forward, device, repeats)

        step, draft = target(1), drafter(1)
        by_batch[str(batch)] = {
            "target_step_s": step,
            "drafter_forward_s": draft,
            "drafter_ratio": draft / step,
            "verify_cost": {str(k): max(1.0, target(k + 1) / step) for k in KS[size]},
            "drafter_ratio_by_width": {str(k): drafter(k) / step for k in KS[size]},
        }
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return {
        "device_timings": {
            "device": name,
            "dtype": str(dtype).removeprefix("torch."),
            "shape": shape,
            "repeats": repeats,
            "cuda_graphs": device.startswith("cuda"),
            "by_batch": by_batch,
            "definition": (
                "drafter_ratio: one drafter forward (fc, one layer, draft head; one new token) "
                "over one target decode step (target_layers layers and the head); verify_cost[K]: "
                "the target's forward over K + 1 new tokens over its decode step (at least 1); "
                "each the median of `repeats`"
            ),
        }
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("device_timings.json"))
    args = parser.parse_args(argv)
    timings = measure(args.device, "small" if args.small else "full")
    args.out.write_text(json.dumps(timings, indent=2) + "\n")
    print(json.dumps(timings["device_timings"]["by_batch"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
