"""Acceptance by context depth, measured: drafters trained on the same long-reasoning data with one
thing changed each (the drafter's attention window, the EAGLE-3.1 norms, training samples cut to
a quarter of their length), judged by vLLM's acceptance at each depth of `evaluate.depths`
(held-out samples cut there, the continuation decoded with EAGLE-3) and by the simulated
acceptance past each depth.

    python experiments/depth.py --run-dir results/long-reasoning \\
        --configfile config/tests/long-reasoning.yaml [--variants full window_512 ...] \\
        [--engine vllm|live|none] [--epochs N] [--threads N] [--json out.json]

`--run-dir` is a finished run of that config (or one made here, up to the hidden states, when
omitted). One line per variant and K:

    depth variant=NAME k=K vllm=A@0 A@1024 ... sim=A@0 ... train_tokens_per_s=T changes={...}

`--engine live` decodes with eaglenest's own live loop (transformers target) instead of vLLM
(`live=` in the lines): for drafters vLLM's CPU build cannot serve, such as the Llama-style
drafter beside a DeepSeek-V3 (MLA) target; `mla` and `llama` set the drafter's attention (on the
DeepSeek-V3 demo, whose config trains an MLA drafter, compare `full` with `llama`).

`quarter` trains on each training sample's first quarter only (prompt and the start of its
answer: what a user gets who trains on short samples and serves long ones), `quarter_window_512`
the same with a window of 512; the others train on whole samples. The held-out samples, prompts, engine and seed are the same for every variant.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from run_data import REPO, RunFiles, deep_update, make_run, run_config
from safetensors import safe_open
from safetensors.torch import save_file

from eaglenest.settings.evaluate import EvaluateSettings
from eaglenest.settings.train import TrainSettings
from eaglenest.settings.vllm import VllmRuntime

NO_NORMS = {"fc_norm": False, "norm_output": False}  # the EAGLE-3.1 norms off
VARIANTS: dict[str, dict[str, Any]] = {
    "full": {},
    "window_2048": {"drafter": {"sliding_window": 2048}},
    "window_512": {"drafter": {"sliding_window": 512}},
    "full_no_norms": {"drafter": NO_NORMS},
    "window_2048_no_norms": {"drafter": {"sliding_window": 2048, **NO_NORMS}},
    "window_512_no_norms": {"drafter": {"sliding_window": 512, **NO_NORMS}},
    # Whole-sample training data cut to its first quarter (cut_shard), in batches of a quarter
    # of the size, so that it takes about as many steps as `full` (the long demo's drafter takes
    # off after ~55 steps: with fewer, this would measure too few steps, not short samples).
    "quarter": {"max_batch_tokens": 512},
    # The same short samples with a window shorter than them: whether a window keeps a drafter
    # trained short from losing acceptance when served long (a window sees the same span at
    # every depth; full attention meets spans past anything it trained on).
    "quarter_window_512": {"max_batch_tokens": 512, "drafter": {"sliding_window": 512}},
    # The drafter's attention: DeepSeek-V3's MLA (its targets' drafters), or the Llama-style one
    # (on config/tests/deepseek-v3.yaml, whose drafter is MLA, `full` is the MLA drafter).
    "mla": {"drafter": {"attention": "mla"}},
    "llama": {"drafter": {"attention": "llama"}},
}
CUT = {"quarter": 4, "quarter_window_512": 4}


def cut_shard(source: Path, out: Path, fraction: int) -> int:
    """A copy of hidden-state shard `source` holding each sample's first 1/fraction of rows (at
    least its first row); returns the rows kept."""
    with safe_open(str(source), framework="pt") as f:
        metadata = f.metadata()
        offsets = f.get_tensor("offsets")
        names = [n for n in f.keys() if n != "offsets"]  # noqa: SIM118 (not iterable)
        bounds = offsets.tolist()
        keep = [(a, a + max(1, (b - a) // fraction)) for a, b in itertools.pairwise(bounds)]
        tensors = {n: torch.cat([f.get_slice(n)[a:b] for a, b in keep]) for n in names}
    lengths = torch.tensor([b - a for a, b in keep])
    tensors["offsets"] = torch.cat([torch.zeros(1, dtype=lengths.dtype), lengths.cumsum(0)]).to(
        offsets.dtype
    )
    save_file(tensors, str(out), metadata=metadata)
    return int(lengths.sum())


class Study:
    def __init__(self, run_dir: Path, config: dict[str, Any], engine: str, work: Path):
        self.run_dir, self.config, self.work = run_dir, config, work
        self.files = RunFiles.of(run_dir, config)
        self.target = self.files.target
        evaluate = EvaluateSettings.from_config(config).with_target_path(self.target)
        if not evaluate.depths:
            raise SystemExit("depth study: the config has no evaluate.depths")
        vllm = engine == "vllm"
        self.evaluate = replace(evaluate, live=engine == "live", engine="vllm" if vllm else None)
        self.runtime = VllmRuntime.from_config(config) if vllm else None

    def training_shards(self, name: str) -> tuple[list[Path], int]:
        """The variant's training shards and their rows."""
        fraction = CUT.get(name)
        if fraction is None:
            return self.files.train_hidden, sum(_rows(p) for p in self.files.train_hidden)
        folder = self.work / name / "cut"
        folder.mkdir(parents=True, exist_ok=True)
        paths, rows = [], 0
        for path in self.files.train_hidden:
            paths.append(folder / path.name)
            rows += cut_shard(path, paths[-1], fraction)
        return paths, rows

    def measure(self, name: str, change: dict[str, Any]) -> dict[str, Any]:
        # Whole samples, as the study was designed (train.sequence came after it; a sink is
        # refused beside a window).
        whole = {"sequence": {"mode": "whole"}}
        config = deep_update(copy.deepcopy(self.config), {"train": whole})
        config = deep_update(config, {"train": copy.deepcopy(change)})
        settings = TrainSettings.from_config(config).with_target_path(self.target)
        out = self.work / name
        shards, rows = self.training_shards(name)
        report, metrics, train_s = self.files.train_and_evaluate(
            out, settings, self.evaluate, self.runtime, train_hidden=shards
        )
        return {
            "changes": change,
            "cut": CUT.get(name),
            "train_rows": rows,
            "train_s": train_s,
            "train_tokens_per_s": rows * report["epochs"] / report["wall_s"],
            "by_depth": metrics["by_depth"],
        }


def _rows(path: Path) -> int:
    with safe_open(str(path), framework="pt") as f:
        return int(f.get_tensor("offsets")[-1])


def lines(name: str, result: dict[str, Any]) -> list[str]:
    """One line per K: each measurement's acceptance at each depth (`-` where no prompt)."""
    table = result["by_depth"]
    out = []
    for k, rows in table["per_k"].items():
        figures = []
        for which, label in (("engine", "vllm"), ("live", "live"), ("simulated", "sim")):
            if not any(row.get(which) for row in rows):
                continue
            values = [
                f"{row[which]['acceptance_length']:.3f}@{row['depth']}"
                if row.get(which)
                else f"-@{row['depth']}"
                for row in rows
            ]
            figures.append(f"{label}={' '.join(values)}")
        out.append(
            f"depth variant={name} k={k} {' '.join(figures)} "
            f"train_tokens_per_s={result['train_tokens_per_s']:.0f} "
            f"changes={json.dumps(result['changes'], separators=(',', ':'))}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, help="a run's results/{run} (else made here)")
    parser.add_argument("--configfile", type=Path, nargs="+", required=True)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--engine", choices=["vllm", "live", "none"], default="vllm")
    parser.add_argument(
        "--epochs", type=int, help="train.epochs for every variant (else the config's)"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = run_config(args.configfile)
    if args.epochs:
        config["train"]["epochs"] = args.epochs
    if args.engine == "vllm" and not (REPO / VllmRuntime.from_config(config).python).exists():
        sys.exit("depth study: --engine vllm needs .venv-vllm (make vllm)")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or make_run(
            args.configfile, Path(tmp) / "workflow", config["run"], args.threads, hidden=True
        )
        study = Study(run_dir.resolve(), config, args.engine, Path(tmp))
        print(f"depth study: depths {list(study.evaluate.depths)}, Ks {list(study.evaluate.ks)}, "
              f"engine {args.engine}", flush=True)  # fmt: skip
        for name in args.variants:
            results[name] = study.measure(name, VARIANTS[name])
            for text in lines(name, results[name]):
                print(text, flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
