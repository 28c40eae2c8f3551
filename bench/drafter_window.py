"""Training tokens/s and peak memory of the drafter with a sliding window
(`train.drafter.sliding_window`) against full attention, on long samples.

One 7-step TTT training step (forward, loss, backward: bench/train.py's `long_context_step`, CPU
sizes H 256 and 4 heads, Llama-8B sizes on CUDA) on one sample of each length (`--lengths`, default
2,048 and 8,192 tokens), with full attention and with each window (`--windows`, default 512 and
2,048) shorter than the sample, each in a fresh process (peak resident memory on the CPU, peak
allocated on CUDA). One line per run, then the ratios to full attention at that length:

    drafter_window T=<T> window=<W|full> tokens_per_s=<R> peak_mib=<M> seconds=<S>
    drafter_window T=<T> window=<W> speedup=<R / R_full> memory=<M / M_full>

Usage: python bench/drafter_window.py [--lengths 2048 8192] [--windows 512 2048] [--device cpu]
                                      [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
LENGTHS = (2048, 8192)
WINDOWS = (512, 2048)


def bench_train():
    """bench/train.py as a module: its long-context step."""
    spec = importlib.util.spec_from_file_location(
        "drafter_window_bench_train", BENCH_DIR / "train.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one(length: int, window: int | None, device: str, threads: int) -> dict:
    """A step in a fresh process, so each peak is its own."""
    command = [sys.executable, __file__, "--one", str(length), str(window or 0),
               "--device", device, "--threads", str(threads)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"T={length} window={window}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--windows", type=int, nargs="+", default=list(WINDOWS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--one", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        length, window = args.one
        step = bench_train().long_context_step(length, args.device, sliding_window=window or None)
        print(json.dumps({**step, "window": window or None}))
        return
    rows, ratios = [], []
    for length in args.lengths:
        full = None
        for window in [None, *sorted(w for w in args.windows if w < length)]:
            row = one(length, window, args.device, args.threads)
            rows.append(row)
            print(f"drafter_window T={length} window={window or 'full'} "
                  f"tokens_per_s={row['tokens_per_s']:.0f} peak_mib={row['peak_mib']:.0f} "
                  f"seconds={row['seconds']:.1f}", flush=True)  # fmt: skip
            if window is None:
                full = row
                continue
            ratio = {"T": length, "window": window,
                     "speedup": row["tokens_per_s"] / full["tokens_per_s"],
                     "memory": row["peak_mib"] / full["peak_mib"]}  # fmt: skip
            ratios.append(ratio)
            print(f"drafter_window T={length} window={window} speedup={ratio['speedup']:.2f} "
                  f"memory={ratio['memory']:.2f}", flush=True)  # fmt: skip
    if args.json:
        results = {"device": args.device, "threads": args.threads, "rows": rows, "ratios": ratios}
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
