"""The drafter recipe, measured: each variant of the training recipe trained on the same data with
everything else fixed, judged by vLLM's acceptance (EAGLE-3 decoding of the held-out prompts) and
by the simulated acceptance on the held-out shard.

A variant changes one thing of the run's `train` section (architecture option, loss, target mass
outside the draft vocabulary, LM head initialisation, aux noise, TTT inputs, grad clip, betas,
schedule floor, weight decay, learning rate). After the one-change variants, `combined` takes
every change that beat the baseline by more than `--margin` in vLLM's acceptance (the better one
where two change the same key) and is measured too. The data, batches, seed and steps are the
run's (`--run-dir results/demo` after `make run`, with the `--configfile`s that run used;
without `--run-dir` Snakemake makes the run's data, up to the hidden states, in a temp dir).

One line per variant, then the best (by the mean of vLLM's acceptance ratios to the baseline over
the Ks; simulated when `--engine none`):

    recipe variant=NAME vllm_k3=A vllm_k7=A sim_k3=A sim_k7=A ratio=R heldout_acc0=X
        train_s=S s_per_epoch=E epoch_time_ratio=Q changes={...}
    recipe best=NAME ...

Usage: python experiments/recipe.py [--run-dir results/demo] [--configfile FILE ...]
           [--variants baseline lm_head_target ...] [--prompts 32] [--engine auto|vllm|none]
           [--base JSON] [--threads N] [--json out.json]

The variants change the config's defaults (config/config.yaml over config/schema.yaml, which
since this study hold its best recipe); `--base` measures them on top of another starting point,
e.g. the recipe before (`--base '{"drafter": {"norm_before_residual": false}}'`).

`--external NAME=DIR` decodes a drafter trained elsewhere (any checkpoint vLLM loads as EAGLE-3,
e.g. one vllm-project/speculators saved, trained on this run's data) with the same prompts and
engine, one line each after the variants:

    recipe external=NAME vllm_k3=A vllm_k7=A ratio=R first_position_k3=P
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from run_data import REPO, RunFiles, deep_update, make_run, run_config

from eaglenest.settings.evaluate import EvaluateSettings
from eaglenest.settings.train import TrainSettings
from eaglenest.settings.vllm import VllmEngine, VllmRuntime
from eaglenest.stages.evaluate.live import heldout_prompts
from eaglenest.stages.evaluate.vllm_evaluate import decode, engine_request, evaluate_in_vllm

# One change each to the run's `train` section, in the order they are measured (the ones the
# peer comparison pointed at first).
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "lm_head_target": {"lm_head_init": "target"},
    "lm_head_frozen": {"lm_head_init": "target_frozen"},
    "norm_before_residual": {"drafter": {"norm_before_residual": True}},
    "aux_noise_0.05": {"aux_noise": 0.05},
    "ttt_drafter_tokens": {"ttt_inputs": "drafter"},
    "betas_0.999": {"adam_betas": [0.9, 0.999]},
    "grad_clip_1": {"grad_clip": 1.0},
    "lr_to_zero": {"min_lr_ratio": 0.0},
    "weight_decay_0.01": {"weight_decay": 0.01},
    "norm_output": {"drafter": {"norm_output": True}},
    "norm_before_fc": {"drafter": {"norm_before_fc": True}},
    "fc_norm": {"drafter": {"fc_norm": True}},
    "hard_cross_entropy": {"loss": "hard_cross_entropy"},
    "outside_vocab_ignored": {"target_outside_vocab": "ignore"},
    "lr_1e-3": {"lr": 1.0e-3},
    "lr_1e-2": {"lr": 1.0e-2},
    # The other way round, from the recipe the first pass chose (config/schema.yaml's defaults).
    "norm_before_residual_off": {"drafter": {"norm_before_residual": False}},
    "norm_output_off": {"drafter": {"norm_output": False}},
    "norm_before_fc_off": {"drafter": {"norm_before_fc": False}},
    "fc_norm_off": {"drafter": {"fc_norm": False}},
    "cross_entropy": {"loss": "cross_entropy"},
    "norm_before_fc_and_norm_output_off": {
        "drafter": {"norm_before_fc": False, "norm_output": False}
    },
    "lm_head_random": {"lm_head_init": "random"},
    "step_weight_1": {"step_weight": 1.0},  # every TTT step weighs the same (speculators')
    "step_weight_0.6": {"step_weight": 0.6},  # the first drafts weigh more
    "lr_2e-3": {"lr": 2.0e-3},
    "lr_5e-3": {"lr": 5.0e-3},
    "batch_tokens_4096": {"max_batch_tokens": 4096},  # half the steps, twice the tokens each
    "norm_before_fc_off_grad_clip_1": {"drafter": {"norm_before_fc": False}, "grad_clip": 1.0},
    "loss_on_prompt": {"loss_positions": "all"},  # the prompt's positions count too
    "batch_tokens_1024": {"max_batch_tokens": 1024},  # twice the steps, half the tokens each
    "batch_tokens_512": {"max_batch_tokens": 512},
    "batch_tokens_256": {"max_batch_tokens": 256},
    "init_std_0.02": {"init_std": 0.02},  # transformers' (and speculators') initialisation
    # The batches' composition: fixed length-sorted batches (the recipe before), or new ones each
    # epoch from random pools of fewer batches' worth of samples (more random, more padding).
    "shuffle_pool_0": {"shuffle_pool": 0},
    "shuffle_pool_2": {"shuffle_pool": 2},
    "shuffle_pool_1": {"shuffle_pool": 1},
    # New random batches every epoch, lengths mixed, several samples a row (no padding to speak of).
    "packing": {"packing": True},
    # Every setting of the peer's run (vllm-project/speculators 0.9.0 defaults, its best
    # variant): where eaglenest's recipe and its differ, the peer's.
    "speculators_like": {
        "drafter": {"norm_before_fc": False, "fc_norm": False, "norm_output": False},
        "loss": "forward_kl",
        "adam_betas": [0.9, 0.999],
        "weight_decay": 0.01,
        "grad_clip": 1.0,
        "min_lr_ratio": 0.0,
        "lm_head_init": "target_frozen",
    },
}
VARIANTS["speculators_like_init_0.02"] = {**VARIANTS["speculators_like"], "init_std": 0.02}


def flat_keys(change: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in change.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def combine(results: dict[str, Any], margin: float) -> dict[str, Any]:
    """The changes that beat the baseline by more than `margin`; of two that set the same key,
    the better one's."""
    chosen: dict[str, tuple[float, Any]] = {}
    for name, result in results.items():
        if name in ("baseline", "combined") or result["ratio"] <= 1 + margin:
            continue
        for key, value in flat_keys(result["changes"]).items():
            if key not in chosen or chosen[key][0] < result["ratio"]:
                chosen[key] = (result["ratio"], value)
    change: dict[str, Any] = {}
    for key, (_, value) in chosen.items():
        *parents, last = key.split(".")
        place = change
        for parent in parents:
            place = place.setdefault(parent, {})
        place[last] = value
    return change


class Study:
    def __init__(self, run_dir: Path, config: dict[str, Any], prompts: int, engine: bool,
                 work: Path):  # fmt: skip
        self.run_dir, self.config, self.engine, self.work = run_dir, config, engine, work
        self.files = RunFiles.of(run_dir, config)
        self.target = self.files.target
        self.heldout_tokens = self.files.heldout_tokens
        evaluate = EvaluateSettings.from_config(config)
        self.ks = evaluate.ks
        evaluate = replace(evaluate, live=False, engine=None, vllm=None, live_prompts=prompts)
        self.evaluate = evaluate.with_target_path(self.target)
        self.prompts = heldout_prompts(self.heldout_tokens, prompts)
        self.plain = None

    def engine_figures(self, drafter_dir: Path) -> dict[str, Any]:
        # As the evaluate stage decodes on the CPU (float32); a GPU engine would take "auto".
        model_dtype = "float32" if not torch.cuda.is_available() else "auto"
        engine, runtime = VllmEngine.from_config(self.config), VllmRuntime.from_config(self.config)
        arguments = {
            "prompts": self.prompts, "drafter_dir": drafter_dir, "target_path": self.target,
            "max_new_tokens": self.evaluate.live_max_new_tokens, "model_dtype": model_dtype,
            "engine": engine, "runtime": runtime,
        }  # fmt: skip
        if self.plain is None:  # once for every variant: the same prompts, the same target
            work = self.work / "plain"
            work.mkdir(parents=True, exist_ok=True)
            self.plain = decode({**engine_request(**arguments), "k": None}, runtime, work)
        return evaluate_in_vllm(**arguments, ks=self.ks, plain=self.plain)

    def measure(self, name: str, change: dict[str, Any]) -> dict[str, Any]:
        config = deep_update(copy.deepcopy(self.config), {"train": copy.deepcopy(change)})
        settings = TrainSettings.from_config(config).with_target_path(self.target)
        out = self.work / name
        report, metrics, train_s = self.files.train_and_evaluate(out, settings, self.evaluate)
        engine = self.engine_figures(out / "drafter") if self.engine else None
        return {
            "changes": change,
            "vllm": {k: v["acceptance_length"] for k, v in engine["per_k"].items()}
            if engine
            else None,
            "vllm_identical_to_plain": all(
                v["identical_to_plain"] for v in engine["per_k"].values()
            )
            if engine
            else None,
            "vllm_per_position": {
                k: v["per_position_acceptance"] for k, v in engine["per_k"].items()
            }
            if engine
            else None,
            "simulated": {k: v["acceptance_length"] for k, v in metrics["simulated"].items()},
            "heldout_acc": report["heldout_acc"],
            "train_s": train_s,
            "s_per_epoch": report["wall_s"] / report["epochs"],
        }


def score(result: dict[str, Any], baseline: dict[str, Any]) -> float:
    """Mean over the Ks of the acceptance over the baseline's (vLLM's when measured)."""
    which = "vllm" if result["vllm"] else "simulated"
    ratios = [a / baseline[which][k] for k, a in result[which].items()]
    return sum(ratios) / len(ratios)


def line(name: str, result: dict[str, Any], baseline: dict[str, Any]) -> str:
    figures = [f"vllm_k{k}={a:.4f}" for k, a in (result["vllm"] or {}).items()]
    figures += [f"sim_k{k}={a:.4f}" for k, a in result["simulated"].items()]
    return (
        f"variant={name} {' '.join(figures)} ratio={result['ratio']:.4f} "
        f"heldout_acc0={result['heldout_acc'][0]:.4f} train_s={result['train_s']:.1f} "
        f"s_per_epoch={result['s_per_epoch']:.2f} "
        f"epoch_time_ratio={result['s_per_epoch'] / baseline['s_per_epoch']:.3f} "
        f"changes={json.dumps(result['changes'], separators=(',', ':'))}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, help="a run's results/{run} (else made here)")
    parser.add_argument("--configfile", type=Path, nargs="+", default=[])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts decoded")
    parser.add_argument(
        "--engine",
        choices=["auto", "vllm", "none"],
        default="auto",
        help="auto: vLLM when the config's vllm.python exists (make's .venv-vllm), else none",
    )
    parser.add_argument("--margin", type=float, default=0.01, help="gain a change must show")
    parser.add_argument("--no-combined", action="store_true")
    parser.add_argument(
        "--base",
        type=json.loads,
        default={},
        help="a change under every variant, the baseline included (JSON, e.g. '{\"lr\": 0.01}')",
    )
    parser.add_argument(
        "--external",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="drafters trained elsewhere, decoded by vLLM like the variants",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = deep_update(run_config(args.configfile), {"train": args.base})
    names = ["baseline", *[n for n in args.variants if n != "baseline"]]
    results: dict[str, Any] = {}
    engine = args.engine
    if engine == "auto":
        engine = "vllm" if (REPO / VllmRuntime.from_config(config).python).exists() else "none"
    if args.external and engine != "vllm":
        parser.error("--external needs vLLM (--engine vllm, or auto with make's .venv-vllm)")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or make_run(
            args.configfile, Path(tmp) / "workflow", config["run"], args.threads, hidden=True
        )
        study = Study(run_dir.resolve(), config, args.prompts, engine == "vllm", Path(tmp))
        print(f"recipe study: {len(study.prompts)} held-out prompts, Ks {list(study.ks)}, "
              f"engine {engine}", flush=True)  # fmt: skip

        def run(name: str, change: dict[str, Any]) -> None:
            results[name] = study.measure(name, change)
            results[name]["ratio"] = score(results[name], results["baseline"] if results.get(
                "baseline") else results[name])  # fmt: skip
            print("recipe " + line(name, results[name], results["baseline"]), flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=2) + "\n")

        base = TrainSettings.from_config(config)
        for name in names:
            changed = deep_update(copy.deepcopy(config), {"train": copy.deepcopy(VARIANTS[name])})
            if name != "baseline" and TrainSettings.from_config(changed) == base:
                print(f"recipe variant={name} skipped: the baseline already has it", flush=True)
                continue
            run(name, VARIANTS[name])
        change = combine(results, args.margin)
        if not args.no_combined and change and len(flat_keys(change)) > 1:
            run("combined", change)
        if engine == "vllm":
            for name, drafter_dir in (item.split("=", 1) for item in args.external):
                external = study.engine_figures(Path(drafter_dir))
                figures = {k: v["acceptance_length"] for k, v in external["per_k"].items()}
                ratio = score({"vllm": figures}, results["baseline"])
                first = external["per_k"][str(min(study.ks))]["per_position_acceptance"][0]
                print(f"recipe external={name} "
                      + " ".join(f"vllm_k{k}={a:.4f}" for k, a in figures.items())
                      + f" ratio={ratio:.4f} first_position_k{min(study.ks)}={first:.3f}",
                      flush=True)  # fmt: skip
    best = max(results, key=lambda n: results[n]["ratio"])
    print("recipe best=" + line(best, results[best], results["baseline"]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
