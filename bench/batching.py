"""Batching benchmark: how much of what training computes is padding, per way of batching.

For each length distribution, one epoch's batches (`common/batching`) under each budget:
- fixed: length-sorted batches (`pack_batches`, `train.packing: false`, `shuffle_pool: 0`),
- packed: the training default (`packed_batches`: short samples packed several to a row in a
  random order; samples over PACK_MAX_LENGTH one to a row, from length-sorted pools),
- random: every sample in a random order, one to a row, as a random sampler without packing or
  pools would batch them (the cost packing and pools avoid).
Figures: batches, fill (real tokens / tokens computed, padding included: rows x the widest row)
and tokens computed relative to fixed. Training time per epoch follows tokens computed closely,
plus the packed rows' dense attention (experiments/RESULTS.md, round 8).

Distributions: `--run-dir` a run's hidden shards (the demo's ~45-130 tokens a sample), and a
synthetic reasoning-length one (lognormal, median 3000 tokens, 200-32K, 65% over 2048).

Usage: python bench/batching.py [--run-dir results/demo] [--run-budgets 1024 2048]
                                [--reasoning-budgets 16384 65536] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from eaglenest.common.batching import pack_batches, packed_batches, packed_rows
from eaglenest.formats.hidden_shard import HiddenShard


def computed_tokens(lengths: np.ndarray, batches: list[list[int]], budget: int, packed: bool):
    total = 0
    for batch in batches:
        sizes = lengths[batch]
        rows = packed_rows(sizes, budget) if packed else [[i] for i in range(len(batch))]
        total += len(rows) * max(int(sizes[row].sum()) for row in rows)
    return total


def random_batches(lengths: np.ndarray, budget: int, rng: np.random.Generator):
    batches, current = [], []
    for i in rng.permutation(len(lengths)).tolist():
        if current and (len(current) + 1) * int(lengths[[*current, i]].max()) > budget:
            batches.append(current)
            current = []
        current.append(i)
    return [*batches, current] if current else batches


def measure(name: str, lengths: np.ndarray, budgets: list[int]) -> list[dict]:
    rows = []
    for budget in budgets:
        rng = np.random.default_rng(0)
        ways = {
            "fixed": (pack_batches(lengths, budget), False),
            "packed": (packed_batches(lengths, budget, rng), True),
            "random": (random_batches(lengths, budget, rng), False),
        }
        fixed = computed_tokens(lengths, ways["fixed"][0], budget, False)
        for way, (batches, packed) in ways.items():
            computed = computed_tokens(lengths, batches, budget, packed)
            row = {"lengths": name, "budget": budget, "batching": way, "batches": len(batches),
                   "fill": round(int(lengths.sum()) / computed, 3),
                   "tokens_vs_fixed": round(computed / fixed, 3)}  # fmt: skip
            print("batching " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            rows.append(row)
    return rows


def run_lengths(run_dir: Path) -> np.ndarray:
    shards = [HiddenShard(p) for p in sorted((run_dir / "hidden").glob("0*.safetensors"))]
    return np.concatenate([np.diff(shard.offsets) for shard in shards])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, help="a run's results/{run}")
    parser.add_argument("--run-budgets", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--reasoning-budgets", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    reasoning = np.clip(rng.lognormal(np.log(3000), 0.9, 5000).astype(np.int64), 200, 32000)
    rows = measure("reasoning", reasoning, args.reasoning_budgets)
    if args.run_dir:
        rows += measure(args.run_dir.name, run_lengths(args.run_dir), args.run_budgets)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
