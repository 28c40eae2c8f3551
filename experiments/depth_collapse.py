"""Drafters that hold at the target's lengths, measured: the peers' recipe against eaglenest's on
one capture of the collapsing demo (demo_target.tasks cite: a walk, then past a depth D a recital
of the prompt's book, a word at a time, at a distance as deep as the answer), EAGLE-3 and DFlash,
by generated depth in vLLM and in our own live loop, with the oracle at every depth.

Recipes (train.sequence, everything else the config's: the same drafter, steps and tokens):
- `peers_<L>`: each answer cut to its first L tokens, positions from 0 (`mode: head`): what the
  peers' defaults train on (SpecForge and ModelOpt 2,048-4,096, speculators 8,192);
- `ours_<L>`: eaglenest's, `mode: windows` with the prompt as the sink and a window of the rest of
  L at a random depth, true positions: the same L tokens a sample, taken across the whole depth;
- ablations: `nosink_<L>` (windows without the prompt: positions and content across depth, not
  the context the words need) and the control `window_<W>` (a sliding window of W shorter than
  the citing distance, trained as served: it cannot see the book, so no recipe can help it).

For each: vLLM's and the live loop's acceptance length and rounds by depth, summary.json's
`depth_health` verdict, training seconds and peak memory (the training's own process). The
oracle (stages/evaluate/speculative.py `ContinuationProposer`) drafts the sample's own tokens:
K + 1 a round at every depth, or the target is not exact there.

    python experiments/depth_collapse.py --configfile config/tests/depth-collapse-study.yaml \\
        [--seed S] [--quick] [--train-seeds 0 1 2] [--families eagle3 dflash] [--epochs N] \\
        --out FILE

`--seed` draws another target of the same kind (demo_target.seed: frequencies, books, keys and
walks); `--quick` caps the depths at 16,384 (and the answers with them: demo_target.cite.states
5,120) and trains one seed. FILE: {"k", "depths", "oracle": {depth: tau}, "recipes": {name:
{"family", "peers", "run", "vllm", "live", "vllm_rounds", "live_rounds", ...}}}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from run_data import REPO, RunFiles, deep_update, make_run, run_config

QUICK_DEPTH = 16_384
QUICK_STATES = 5_120


def recipes(config: dict[str, Any], families: list[str], peer_lengths: list[int],
            window: int | None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """name -> the change to `train` (the family and its sequence recipe)."""
    ours = config["train"]["sequence"]["length"]
    out: dict[str, dict[str, Any]] = {}
    for family in families:
        for length in peer_lengths:
            out[f"{family}_peers_{length}"] = {
                "families": [family],
                "sequence": {"mode": "head", "length": length},
            }
        out[f"{family}_ours_{ours}"] = {"families": [family], "sequence": {"mode": "windows"}}
    out[f"{families[0]}_nosink_{ours}"] = {
        "families": [families[0]],
        "sequence": {"mode": "windows", "sink": 0},
    }
    if window:
        out[f"{families[0]}_window_{window}"] = {
            "families": [families[0]],
            "sequence": {"mode": "windows", "sink": 0},
            "drafter": {"sliding_window": window},
        }
    return out


def by_depth(metrics: dict[str, Any], k: str, which: str) -> tuple[dict, dict, dict]:
    """(acceptance, rounds, rounds per prompt) by depth of one measurement (engine or live)."""
    tau, rounds, per_prompt = {}, {}, {}
    for row in metrics["by_depth"]["per_k"][k]:
        figures = row.get(which) or {}
        if figures.get("acceptance_length") is None:
            continue
        depth = str(row["depth"])
        tau[depth] = figures["acceptance_length"]
        rounds[depth] = figures.get("rounds")
        per_prompt[depth] = figures.get("rounds_per_prompt")
    return tau, rounds, per_prompt


def train_one(spec: dict[str, Any]) -> None:
    """In its own process (its peak memory is the recipe's): train and evaluate one recipe."""
    import torch

    from eaglenest.settings.evaluate import EvaluateSettings
    from eaglenest.settings.train import TrainSettings
    from eaglenest.settings.vllm import VllmRuntime
    from eaglenest.stages.report.depth_health import family_health

    torch.set_num_threads(spec["threads"])
    config, out = spec["config"], Path(spec["out"])
    files = RunFiles.of(Path(spec["run_dir"]), config)
    train = TrainSettings.from_config(config).with_target_path(files.target)
    evaluate = EvaluateSettings.from_config(config).with_target_path(files.target)
    runtime = VllmRuntime.from_config(config) if evaluate.engine == "vllm" else None
    started = time.perf_counter()
    report, metrics, train_s = files.train_and_evaluate(out, train, evaluate, runtime)
    family = config["train"]["families"][0]
    suffix = "" if family == "eagle3" else f"_{family}"
    drafter_config = json.loads((out / "drafter" / "config.json").read_text())
    health = family_health(metrics, drafter_config, report, config["report"]["collapse_ratio"])
    result = {
        "family": family,
        "train_s": train_s,
        "wall_s": time.perf_counter() - started,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "train_report": report,
        "metrics": metrics,
        "depth_health": health,
        "suffix": suffix,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")


def oracle(run_dir: Path, config: dict[str, Any], threads: int) -> dict[str, float]:
    """The oracle's acceptance length by depth: the live loop with ContinuationProposer on the
    held-out samples cut at each depth."""
    import polars as pl
    import torch

    from eaglenest.settings.evaluate import EvaluateSettings
    from eaglenest.stages.evaluate.depths import cut_at_depths
    from eaglenest.stages.evaluate.live import eos_token_ids, live
    from eaglenest.stages.evaluate.speculative import ContinuationProposer
    from eaglenest.target_model.loading import load_target

    torch.set_num_threads(threads)
    files = RunFiles.of(run_dir, config)
    evaluate = EvaluateSettings.from_config(config)
    k = max(evaluate.ks)
    target = load_target(files.target, model_dtype="float32")
    eos = eos_token_ids(files.target, target)
    samples = [
        list(ids)
        for path in files.heldout_tokens
        for ids in pl.read_parquet(path, columns=["input_ids"])["input_ids"].to_list()
    ]
    found = {}
    cuts = cut_at_depths(
        files.heldout_tokens, evaluate.depths, evaluate.live_prompts, evaluate.live_max_new_tokens
    )
    for cut in cuts:
        if not cut.prompts:
            continue
        proposer = {"oracle": ContinuationProposer(samples)}
        figures = live(target, proposer, cut.prompts, (k,), evaluate.live_max_new_tokens, eos, [])
        found[str(cut.depth)] = figures["oracle"][str(k)]["acceptance_length"]
        print(
            f"depth collapse: oracle at depth {cut.depth}: {found[str(cut.depth)]:.3f}", flush=True
        )
    return found


def study_config(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the run's config, the change written over the configfiles for the run)."""
    change: dict[str, Any] = {"vllm": {"python": str(REPO / ".venv-vllm" / "bin" / "python")}}
    if args.seed is not None:
        change["demo_target"] = {"seed": args.seed}
    base = run_config(args.configfile)
    if args.quick:
        cite = dict(base["demo_target"]["cite"])
        if cite["states"] > QUICK_STATES:
            walk = [min(w, QUICK_STATES - 2) for w in cite["walk"]]
            change.setdefault("demo_target", {})["cite"] = {"states": QUICK_STATES, "walk": walk}
        depths = [d for d in base["evaluate"]["depths"] if d <= QUICK_DEPTH]
        change["evaluate"] = {"depths": depths}
    return deep_update(copy.deepcopy(base), copy.deepcopy(change)), change


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configfile", type=Path, nargs="+", required=True)
    parser.add_argument("--seed", type=int, help="demo_target.seed (another target and prompts)")
    parser.add_argument("--quick", action="store_true", help="depths to 16,384, one seed")
    parser.add_argument("--train-seeds", type=int, nargs="+", help="train.seed of each run")
    parser.add_argument("--families", nargs="+", default=["eagle3", "dflash"])
    parser.add_argument("--peer-lengths", type=int, nargs="+", help="the peers' cuts")
    parser.add_argument("--window", type=int, help="the control's sliding window")
    parser.add_argument("--epochs", type=int, help="train.epochs of every recipe (the budget)")
    parser.add_argument("--only", nargs="+", help="these recipes (names as printed)")
    parser.add_argument("--run-dir", type=Path, help="a capture made before by the same config")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train-one", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_one:
        return train_one(json.loads(args.train_one.read_text()))
    config, change = study_config(args)
    if args.epochs:
        config["train"]["epochs"] = args.epochs
    seeds = args.train_seeds or ([config["train"]["seed"]] if args.quick else [0, 1, 2])
    length = config["train"]["sequence"]["length"]
    peer_lengths = args.peer_lengths or sorted({length // 4, length})
    work = args.workdir or Path(tempfile.mkdtemp(prefix="depth-collapse-"))
    work.mkdir(parents=True, exist_ok=True)
    override = work / "study.yaml"
    override.write_text(yaml.safe_dump(change))
    files = [p.resolve() for p in args.configfile] + [override]
    started = time.perf_counter()
    run_dir = (
        args.run_dir or make_run(files, work / "workflow", config["run"], args.threads, True)
    ).resolve()
    capture_s = time.perf_counter() - started
    k = str(max(config["evaluate"]["ks"]))
    found: dict[str, Any] = {
        "k": int(k),
        "depths": list(config["evaluate"]["depths"]),
        "seed": config["demo_target"]["seed"],
        "train_seeds": seeds,
        "capture": {"run": str(run_dir), "seconds": capture_s},
        "oracle": oracle(run_dir, config, args.threads),
        "recipes": {},
    }
    args.out.write_text(json.dumps(found, indent=2) + "\n")
    for name, train in recipes(config, args.families, peer_lengths, args.window).items():
        if args.only and name not in args.only:
            continue
        for seed in seeds:
            key = name if len(seeds) == 1 else f"{name}_s{seed}"
            recipe = deep_update(copy.deepcopy(config), {"train": {**train, "seed": seed}})
            out = work / key
            out.mkdir(parents=True, exist_ok=True)
            spec = work / key / "spec.json"
            spec.write_text(json.dumps({"config": recipe, "out": str(out), "run_dir": str(run_dir),
                                        "threads": args.threads}))  # fmt: skip
            command = [sys.executable, __file__, "--configfile", *map(str, args.configfile),
                       "--out", str(args.out), "--train-one", str(spec)]  # fmt: skip
            subprocess.run(command, check=True, cwd=REPO)
            result = json.loads((out / "result.json").read_text())
            vllm, vllm_rounds, vllm_per = by_depth(result["metrics"], k, "engine")
            live_tau, live_rounds, live_per = by_depth(result["metrics"], k, "live")
            found["recipes"][key] = {
                "family": result["family"],
                "peers": "_peers_" in name,
                "recipe": train,
                "train_seed": seed,
                "run": str(out),
                "vllm": vllm,
                "live": live_tau,
                "vllm_rounds": vllm_rounds,
                "live_rounds": live_rounds,
                "vllm_rounds_per_prompt": vllm_per,
                "live_rounds_per_prompt": live_per,
                "depth_health": result["depth_health"],
                "train_s": result["train_s"],
                "peak_rss_mb": result["peak_rss_mb"],
                "steps": result["train_report"]["steps"],
                "train_tokens": result["train_report"]["train_tokens"],
                "max_position_trained": result["train_report"].get("max_position_trained"),
            }
            health = result["depth_health"]
            print(f"depth collapse: {key} vllm {vllm} live {live_tau} collapse_at "
                  f"{health['collapse_at']} ({health['kind']}) train {result['train_s']:.0f} s "
                  f"peak {result['peak_rss_mb']:.0f} MB", flush=True)  # fmt: skip
            args.out.write_text(json.dumps(found, indent=2) + "\n")


if __name__ == "__main__":
    main()
