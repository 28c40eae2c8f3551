"""The drafter's attention on an MLA target: the Llama drafter (`train.drafter.attention: llama`)
against the MLA one vLLM ships for DeepSeek targets (`mla`), trained on the same hidden states
with everything else the run's, judged by live speculative decoding of the held-out prompts with
the target in transformers (vLLM's CPU build serves an MLA target beside an MLA drafter only, so
the Llama one can be decoded by our own loop only here) and by the simulated acceptance.

Needs a DeepSeek-V3 run (`config/tests/deepseek-v3.yaml`, its header has the commands):

    python bench/drafter_attention.py --run-dir results/deepseek-v3 \
        --configfile config/config.yaml config/tests/deepseek-v3.yaml

One line per attention, then the ratio:

    drafter_attention attention=NAME live_k3=A live_k7=A sim_k3=A sim_k7=A params=P train_s=S
        train_tokens_per_s=T
    drafter_attention mla_vs_llama_k3=R mla_vs_llama_k7=R

Without `--run-dir` it says what it needs and measures nothing (bench/run_all.py runs every bench).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from eaglenest.common.config import validate_config
from eaglenest.run.split import split_shards
from eaglenest.settings.evaluate import EvaluateSettings
from eaglenest.settings.train import TrainSettings
from eaglenest.stages.evaluate.evaluate import evaluate_drafter
from eaglenest.stages.train.train import train_drafter

ATTENTIONS = ("llama", "mla")


def run_config(configfiles: list[Path]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for path in configfiles:
        for key, value in (yaml.safe_load(path.read_text()) or {}).items():
            nested = isinstance(value, dict) and isinstance(config.get(key), dict)
            config[key] = {**config[key], **value} if nested else value
    return validate_config(config)


def measure(run_dir: Path, config: dict[str, Any], attention: str, work: Path) -> dict[str, Any]:
    # The run's own split (run/split.py, as the rules divide it); the bench reads every
    # shard's states from hidden/ (hidden.store files, the default).
    split = split_shards(config, store="files", warn=False)
    train_ids, heldout_ids = split.training, split.heldout
    shared = {
        "target_head": run_dir / "hidden" / "target_head.safetensors",
        "draft_vocab": run_dir / "vocab" / "draft_vocab.safetensors",
    }
    train = TrainSettings.from_config(config).with_target_path(run_dir / "target")
    drafter = replace(train.drafter, attention=attention, norm_before_fc=False)
    started = time.perf_counter()
    report = train_drafter(
        train_shards=[run_dir / "hidden" / f"{s}.safetensors" for s in train_ids],
        eval_shards=[],
        out_dir=work / attention / "drafter",
        journal_dir=work / attention / "journal",
        settings=replace(train, drafter=drafter),
        **shared,
    )
    train_s = time.perf_counter() - started
    evaluate = replace(EvaluateSettings.from_config(config), engine=None, vllm=None, device="cpu")
    evaluate = evaluate.with_target_path(run_dir / "target")
    metrics = evaluate_drafter(
        drafter_dir=work / attention / "drafter",
        heldout_hidden=[run_dir / "hidden" / f"{s}.safetensors" for s in heldout_ids],
        heldout_tokens=[run_dir / "tokens" / f"{s}.parquet" for s in heldout_ids],
        out=work / attention / "metrics.json",
        settings=evaluate,
        runtime=None,
        **shared,
    )
    params = sum(p.numel() for p in load_file(work / attention / "drafter" / "model.safetensors")
                 .values())  # fmt: skip
    figures = {"attention": attention, "train_s": round(train_s, 1), "params": params,
               "train_tokens_per_s": round(report["tokens_per_s"])}  # fmt: skip
    for k in map(str, evaluate.ks):
        figures[f"live_k{k}"] = metrics["live"][k]["acceptance_length"]
        figures[f"sim_k{k}"] = metrics["simulated"][k]["acceptance_length"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, help="a DeepSeek-V3 run's results/{run}")
    parser.add_argument("--configfile", type=Path, nargs="+", default=[])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    if args.run_dir is None:
        print("drafter_attention: needs --run-dir of a DeepSeek-V3 run (see its docstring)")
    else:
        torch.set_num_threads(args.threads)
        config = run_config(args.configfile)
        with tempfile.TemporaryDirectory(prefix="eaglenest-attention-") as work:
            for attention in ATTENTIONS:
                figures[attention] = measure(args.run_dir, config, attention, Path(work))
                print("drafter_attention " + " ".join(
                    f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in figures[attention].items()))  # fmt: skip
        ratios = {f"mla_vs_llama_k{k}": figures["mla"][f"live_k{k}"] / figures["llama"][f"live_k{k}"]
                  for k in config["evaluate"]["ks"]}  # fmt: skip
        figures["ratios"] = ratios
        print("drafter_attention " + " ".join(f"{k}={v:.4f}" for k, v in ratios.items()))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
