"""Storage vs acceptance: the drafter trained on hidden states stored as bf16, fp8 and fp8 + top-k,
everything else fixed, with each storage's bytes per token and simulated acceptance.

The run's target, tokens, draft vocabulary and target head come from a run directory
(`--run-dir results/demo`, e.g. after `make run`, with the `--configfile`s that run used), else
Snakemake makes them here, in a temporary copy of the workflow, from `--configfile` over
config/config.yaml (default: the embedded demo). Then, per variant, the stages' own functions:
`extract_hidden_states` writes the training shards with that storage (`hidden.dtype`,
`hidden.target_signal`, `hidden.top_k`; everything else as the run's `hidden` section says),
`train_drafter` trains with the run's `train` settings (same seed, batches and steps), and
`evaluate_drafter` (simulated only) measures the drafter on the held-out shards stored in bf16:
every variant is judged on the same features and the same greedy tokens, as a served drafter
sees the target's own states, so only what training read differs. With `--engine vllm` each
variant's exported drafter is also decoded by vLLM on the held-out prompts (the config's `vllm`
section, the stage's own `evaluate_in_vllm`): the engine's acceptance and its ratio to bf16's.

One line per variant, acceptance length (1 + accepted per round) at each `evaluate.ks`:

    storage variant=fp8 bytes_per_token=B bytes_ratio_to_bf16=R acceptance_k3=A ...
        ratio_to_bf16_k3=R ... within_1pct=yes

Goal (#18): fp8 and top-k within 1% of bf16's acceptance at every K (a ratio >= 0.99); the last
line names the smallest k of `--top-k` that meets it.

Usage: python experiments/storage.py [--run-dir results/demo] [--configfile FILE ...]
                                     [--top-k 32 8 2] [--threads N] [--engine vllm] [--prompts N]
                                     [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from run_data import make_run, run_config

from eaglenest.run.split import split_shards
from eaglenest.settings.evaluate import EvaluateSettings
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.train import TrainSettings
from eaglenest.settings.vllm import VllmEngine, VllmRuntime
from eaglenest.stages.evaluate.evaluate import evaluate_drafter
from eaglenest.stages.hidden_states.extract import extract_hidden_states
from eaglenest.stages.train.train import train_drafter

GOAL_RATIO = 0.99  # within 1% of bf16's acceptance


def storage_variants(top_ks: list[int]) -> dict[str, dict[str, Any]]:
    """`hidden` section overrides per variant, bf16 first (the reference)."""
    variants: dict[str, dict[str, Any]] = {
        "bf16": {"dtype": "bf16", "target_signal": "final_hidden"},
        "fp8": {"dtype": "fp8", "target_signal": "final_hidden"},
    }
    for k in top_ks:
        variants[f"fp8_topk{k}"] = {"dtype": "fp8", "target_signal": "topk", "top_k": k}
    return variants


def extract(
    run_dir: Path, shards: list[str], out_dir: Path, settings: HiddenSettings, target: str
) -> tuple[list[Path], float]:
    """The hidden-state stage over these shards with this storage: (files, bytes per token)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths, n_bytes, n_tokens = [], 0, 0
    for shard in shards:
        path = out_dir / f"{shard}.safetensors"
        tokens = run_dir / "tokens" / f"{shard}.parquet"
        summary = extract_hidden_states(
            tokens=tokens, out=path, settings=settings.with_target_path(target)
        )
        paths.append(path)
        n_bytes += path.stat().st_size
        n_tokens += summary["tokens"]
    return paths, n_bytes / n_tokens


def train_and_evaluate(
    run_dir: Path, train_paths: list[Path], heldout_paths: list[Path], out_dir: Path,
    config: dict[str, Any], target: str, engine: bool = False,
) -> tuple[dict, dict]:  # fmt: skip
    """train_drafter on these shards, then evaluate_drafter (simulated, and in vLLM with
    `engine`) on the held-out ones."""
    shared = {
        "target_head": run_dir / "hidden" / "target_head.safetensors",
        "draft_vocab": run_dir / "vocab" / "draft_vocab.safetensors",
    }
    report = train_drafter(
        train_shards=train_paths,
        eval_shards=heldout_paths,
        out_dir=out_dir / "drafter",
        journal_dir=out_dir / "journal",
        settings=TrainSettings.from_config(config).with_target_path(target),
        **shared,
    )
    heldout_tokens = [run_dir / "tokens" / f"{p.name.split('.')[0]}.parquet" for p in heldout_paths]
    evaluate = replace(EvaluateSettings.from_config(config), live=False, engine=None, vllm=None)
    evaluate = evaluate.with_target_path(target)
    if engine:  # the engine's own decoding of the exported drafter (config's vllm section)
        evaluate = replace(evaluate, engine="vllm", vllm=VllmEngine.from_config(config))
    metrics = evaluate_drafter(
        drafter_dir=out_dir / "drafter",
        heldout_hidden=heldout_paths,
        heldout_tokens=heldout_tokens,
        out=out_dir / "metrics.json",
        settings=evaluate,
        runtime=VllmRuntime.from_config(config) if engine else None,
        **shared,
    )
    return report, metrics


def measure(
    run_dir: Path, config: dict[str, Any], top_ks: list[int], work: Path, engine: bool = False
) -> dict:
    """Every variant's bytes per token, training figures and simulated acceptance per K."""
    # The demo's target is built into the run (rules/common.smk), a real one is target.path.
    demo_target = run_dir / "target"
    target = str(demo_target) if demo_target.is_dir() else config["target"]["path"]
    split = split_shards(config)
    train_ids, heldout_ids = split.training, split.heldout
    base = HiddenSettings.from_config(config)
    reference = replace(base, dtype="bf16", target_signal="final_hidden")
    heldout, _ = extract(run_dir, heldout_ids, work / "heldout_bf16", reference, target)
    results: dict[str, Any] = {}
    for name, storage in storage_variants(top_ks).items():
        started = time.perf_counter()
        settings = replace(base, **storage)
        paths, bytes_per_token = extract(
            run_dir, train_ids, work / name / "hidden", settings, target
        )
        report, metrics = train_and_evaluate(
            run_dir, paths, heldout, work / name, config, target, engine
        )
        per_k = metrics["engine"]["per_k"] if engine else {}
        results[name] = {
            "vllm_acceptance": {k: v["acceptance_length"] for k, v in per_k.items()} or None,
            "storage": storage,
            "bytes_per_token": bytes_per_token,
            "acceptance": {k: v["acceptance_length"] for k, v in metrics["simulated"].items()},
            "heldout_acc": report["heldout_acc"],
            "skipped_outside_vocab_share": report["skipped_outside_vocab_share"],
            "train_steps": report["steps"],
            "wall_s": time.perf_counter() - started,
        }
        print(f"  {name}: {json.dumps(results[name])}", flush=True)
    return results


def with_ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Each variant's bytes and acceptance over bf16's, and whether it meets the goal."""
    reference = results["bf16"]
    for variant in results.values():
        variant["bytes_ratio_to_bf16"] = variant["bytes_per_token"] / reference["bytes_per_token"]
        variant["ratio_to_bf16"] = {
            k: a / reference["acceptance"][k] for k, a in variant["acceptance"].items()
        }
        variant["within_1pct"] = min(variant["ratio_to_bf16"].values()) >= GOAL_RATIO
        if variant["vllm_acceptance"]:
            variant["vllm_ratio_to_bf16"] = {
                k: a / reference["vllm_acceptance"][k]
                for k, a in variant["vllm_acceptance"].items()
            }
    return results


def print_lines(results: dict[str, Any]) -> None:
    for name, variant in results.items():
        acceptance = " ".join(f"acceptance_k{k}={a:.4f}" for k, a in variant["acceptance"].items())
        ratios = " ".join(
            f"ratio_to_bf16_k{k}={r:.4f}" for k, r in variant["ratio_to_bf16"].items()
        )
        engine = " ".join(
            f"vllm_acceptance_k{k}={a:.4f} vllm_ratio_to_bf16_k{k}={variant['vllm_ratio_to_bf16'][k]:.4f}"
            for k, a in (variant["vllm_acceptance"] or {}).items()
        )
        print(
            f"storage variant={name} bytes_per_token={variant['bytes_per_token']:.1f} "
            f"bytes_ratio_to_bf16={variant['bytes_ratio_to_bf16']:.3f} {acceptance} {ratios} "
            f"within_1pct={yes_no(variant['within_1pct'])} {engine}".rstrip()
        )
    meeting = [
        v["storage"]["top_k"]
        for v in results.values()
        if v["storage"]["target_signal"] == "topk" and v["within_1pct"]
    ]
    print(
        f"storage goal: fp8 within 1% of bf16: {yes_no(results['fp8']['within_1pct'])}; "
        f"smallest top-k within 1%: {min(meeting) if meeting else 'none of those tried'}"
    )


def yes_no(value: bool) -> str:
    return "yes" if value else "no"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, help="a run's results/{run} (else made here)")
    parser.add_argument("--configfile", type=Path, nargs="+", default=[])
    parser.add_argument("--top-k", type=int, nargs="+", default=[32, 8, 2])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument(
        "--engine",
        choices=["vllm"],
        help="also decode each variant's drafter in vLLM (the config's vllm section, .venv-vllm)",
    )
    parser.add_argument(
        "--prompts", type=int, help="held-out prompts the engine decodes (evaluate.live_prompts)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = run_config(args.configfile)
    if args.prompts:
        config["evaluate"]["live_prompts"] = args.prompts
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        run_dir = args.run_dir or make_run(
            args.configfile, tmp / "workflow", config["run"], args.threads
        )
        # The share of completion tokens the drafter can propose at all: the same for every
        # variant, it bounds what any storage can reach.
        vocab = json.loads((run_dir / "vocab" / "draft_vocab.json").read_text())
        print(f"run {config['run']}: draft vocabulary {vocab['draft_vocab_size']} ids, "
              f"coverage {vocab['coverage']:.4f}", flush=True)  # fmt: skip
        measured = measure(
            run_dir.resolve(), config, args.top_k, tmp / "variants", args.engine == "vllm"
        )
        results = with_ratios(measured)
    print_lines(results)
    if args.json:
        figures = {"run": config["run"], "goal_ratio": GOAL_RATIO, "variants": results,
                   "draft_vocab_size": vocab["draft_vocab_size"],
                   "draft_vocab_coverage": vocab["coverage"]}  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
