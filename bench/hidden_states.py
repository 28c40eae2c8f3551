"""Hidden-states stage benchmark: tokens/s of the stage against bare forward passes, and bytes/token.

The stage packs a tokens shard into length-sorted batches, runs the target with pre-hooks on the
three aux layers, and writes every sample's rows in place into the laid-out safetensors file. The
baseline runs the same batches through the bare decoder stack (`model.model`, no hooks, nothing
kept). Goal: ratio >= 0.9. Model loading is outside both timings. Variants alternate round by
round and the best round of each counts, so a change in the machine's load does not skew it.

Bytes per token (file size / tokens) for bf16 + final_hidden, fp8 + final_hidden and
fp8 + top-k, next to 8·H bytes: the per-sample-pickle baseline (aux 3H + final H in float16, as
the usual regeneration scripts save them).

The vLLM backend (`hidden.backend: vllm`) on the same tokens, when a vLLM interpreter is there
(`--vllm-python`, default .venv-vllm/bin/python from `make vllm`; `--vllm-python ''` skips it):
tokens/s of vLLM's generate calls against the transformers stage's forward passes, and of the
whole job (vLLM's engine start, 40-90 s here, included) against the transformers stage.

A whole run's capture both ways (`--shards K`, default 3; 0 skips): the same tokens split into K
shards, captured by an engine per shard job (the offline backend, as `vllm.capture_url: null`)
and by one capture server for all of them (`eaglenest serve-capture`, as `vllm.capture_url`):
tokens/s of the whole capture with every engine start included, and engine starts per run. From
those measured parts (seconds per engine start, tokens/s inside the engine) and the Kimi-K2.5
example's shard count, a projection for Kimi-K2.5: starts x load time per start + capture time,
both ways; its load time per start and capture rate are inputs (`--kimi-load-s`,
`--kimi-capture-tokens-per-s`), not measured here (no 8-GPU node, no weights).

The target is `--target DIR` (e.g. results/demo/target), else an untrained demo-architecture
model built here (speed does not depend on training). CPU only.

Usage: python bench/hidden_states.py [--target DIR] [--samples 200] [--min-len 64 --max-len 512]
                                    [--vllm-python PATH] [--shards 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.servers import free_port

from eaglenest.common.batching import pack_batches
from eaglenest.common.config import settings_from_sections
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.hidden_states.extract import extract_hidden_states
from eaglenest.stages.hidden_states.vllm_backend import capture_hidden_states_vllm

DEFAULT_VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
from eaglenest.target_model.loading import default_aux_layer_ids, load_target


def write_tokens(path: Path, n: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, n)
    frame = pl.DataFrame(
        {
            "id": [f"{i:016x}" for i in range(n)],
            "input_ids": [rng.integers(0, vocab, k).tolist() for k in lengths],
            "prompt_len": [int(k) // 4 for k in lengths],
            "n_tokens": lengths.astype(np.int64),
            "token_source": ["server"] * n,
            "truncated": [False] * n,
            "rebuild_agrees": [None] * n,
        },
        schema_overrides={"input_ids": pl.List(pl.Int64), "rebuild_agrees": pl.Boolean},
    )
    frame.write_parquet(path)
    return frame


def demo_target(directory: Path) -> Path:
    from eaglenest.demo.target import build_demo_target
    from eaglenest.settings.demo_target import DemoTargetSettings

    untrained = {"train_steps": 0, "heldout_prompts": 1, "min_reasoning_share": 0.0}
    build_demo_target(directory, settings_from_sections(DemoTargetSettings, demo_target=untrained))
    return directory


@torch.inference_mode()
def bare_forward(model, frame: pl.DataFrame, max_batch_tokens: int) -> float:
    """Seconds for the same batches through model.model, nothing captured or written."""
    ids = frame["input_ids"].to_list()
    started = time.perf_counter()
    for batch in pack_batches(frame["n_tokens"].to_numpy(), max_batch_tokens):
        longest = max(len(ids[i]) for i in batch)
        input_ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, i in enumerate(batch):
            input_ids[row, : len(ids[i])] = torch.as_tensor(ids[i])
            mask[row, : len(ids[i])] = 1
        model.model(input_ids=input_ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - started


def vllm_backend(args, tmp: Path, target: Path, base: dict, results: dict, stage_forward_s):
    """The vLLM backend once on the same tokens and storage (its engine start is in the job)."""
    settings = settings_from_sections(
        HiddenSettings,
        hidden={**base, "dtype": "bf16", "backend": "vllm"},
        target={"path": str(target)},
    )
    runtime = settings_from_sections(VllmRuntime, vllm={"python": args.vllm_python})
    started = time.perf_counter()
    summary = capture_hidden_states_vllm(
        tokens=tmp / "tokens.parquet",
        out=tmp / "vllm.safetensors",
        settings=settings,
        runtime=runtime,
    )
    seconds = time.perf_counter() - started
    n_tokens = results["tokens"]
    return {
        "vllm_tokens_per_s": n_tokens / seconds,
        "vllm_generate_tokens_per_s": summary["forward_tokens_per_s"],
        "ratio_vllm_generate_vs_stage_forward": stage_forward_s / summary["forward_seconds"],
        "ratio_vllm_job_vs_stage": (n_tokens / seconds) / results["stage_tokens_per_s"],
    }


def cut_into_shard_files(tmp: Path, frame: pl.DataFrame, k: int) -> list[Path]:
    """The bench's tokens cut into `k` files of near-equal rows (`--shards K`): not a run's shards
    (run/shards.py cuts by prompts.shard_size, run/split.py divides them), K of them whatever
    the row count."""
    paths = []
    for i, part in enumerate(np.array_split(np.arange(len(frame)), k)):
        path = tmp / f"shard-{i:05d}.parquet"
        frame[part.tolist()].write_parquet(path)
        paths.append(path)
    return paths


def capture_config(args, target: Path, base: dict, url: str | None) -> dict:
    from eaglenest.common.config import validate_config

    return validate_config({
        "run": "bench", "target": {"path": str(target)},
        "hidden": {**base, "dtype": "bf16", "backend": "vllm"},
        "vllm": {"python": args.vllm_python, "capture_url": url},
    })  # fmt: skip


def whole_run_capture(args, tmp: Path, target: Path, base: dict, frame: pl.DataFrame) -> dict:
    """K shards by an engine per shard job, then by one capture server; every start included."""
    from eaglenest.capture.server import capture_server

    shards, n_tokens = cut_into_shard_files(tmp, frame, args.shards), int(frame["n_tokens"].sum())
    runs = {}
    for way in ("per_shard", "server"):
        url = f"http://127.0.0.1:{free_port()}" if way == "server" else None
        config = capture_config(args, target, base, url)
        settings, runtime = HiddenSettings.from_config(config), VllmRuntime.from_config(config)
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(capture_server(config)) if url else None
            engine_s = [server["ready_s"]] if server else []
            for path in shards:
                tick = time.perf_counter()
                summary = capture_hidden_states_vllm(
                    tokens=path,
                    out=path.with_suffix(".safetensors"),
                    settings=settings,
                    runtime=runtime,
                )
                if not server:  # the job's time beside vLLM's generate calls: its engine's start
                    engine_s.append(time.perf_counter() - tick - summary["forward_seconds"])
        seconds = time.perf_counter() - started
        runs[way] = {"seconds": seconds, "tokens_per_s": n_tokens / seconds,
                     "engine_starts": len(engine_s), "engine_start_s": float(np.mean(engine_s)),
                     "capture_s": seconds - sum(engine_s)}  # fmt: skip
    return {
        "shards": args.shards,
        "tokens": n_tokens,
        **runs,
        "speedup_server_vs_per_shard": runs["per_shard"]["seconds"] / runs["server"]["seconds"],
    }


def kimi_projection(args) -> dict:
    """Kimi-K2.5's capture both ways: its example's shards and tokens (samples x ~16K tokens),
    starts x load time per start, plus the tokens at the capture rate."""
    import yaml

    example = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "examples"
                              / "kimi-k2.5.yaml").read_text())  # fmt: skip
    prompts = example["prompts"]
    shards = -(-prompts["max_samples"] // prompts["shard_size"])
    tokens = prompts["max_samples"] * args.kimi_tokens_per_sample
    capture_s = tokens / args.kimi_capture_tokens_per_s
    ways = {"per_shard": shards * (1 + args.kimi_rerun_share), "server": 1}
    return {"shards": shards, "tokens": tokens, "load_s_per_start": args.kimi_load_s,
            "capture_tokens_per_s": args.kimi_capture_tokens_per_s, "capture_h": capture_s / 3600,
            **{f"{way}_starts": starts for way, starts in ways.items()},
            **{f"{way}_h": (starts * args.kimi_load_s + capture_s) / 3600
               for way, starts in ways.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--shards", type=int, default=3, help="whole-run capture: 0 skips it")
    # Kimi-K2.5 on one 8-GPU node: inputs of the projection, not measured here.
    parser.add_argument(
        "--kimi-load-s",
        type=float,
        default=900,
        help="one engine start: ~600 GB of weights onto 8 GPUs, then warm-up",
    )
    parser.add_argument(
        "--kimi-capture-tokens-per-s",
        type=float,
        default=50_000,
        help="prefill of the capture on the node",
    )
    parser.add_argument("--kimi-tokens-per-sample", type=int, default=16_000)
    parser.add_argument(
        "--kimi-rerun-share",
        type=float,
        default=0.1,
        help="share of shards captured twice (a failed or changed shard)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        target = args.target or demo_target(tmp / "target")
        base = {
            "device": "cpu",
            "model_dtype": "float32",
            "max_batch_tokens": args.max_batch_tokens,
        }
        model = load_target(target, base["device"], base["model_dtype"])
        hidden = model.config.hidden_size
        frame = write_tokens(tmp / "tokens.parquet", args.samples, args.min_len, args.max_len,
                             model.config.vocab_size)  # fmt: skip
        n_tokens = int(frame["n_tokens"].sum())
        print(f"target {target}: H={hidden}, layers={model.config.num_hidden_layers}, "
              f"aux {default_aux_layer_ids(model.config.num_hidden_layers)}; "
              f"{args.samples} samples, {n_tokens} tokens, {args.threads} threads")  # fmt: skip

        def stage(**settings) -> tuple[float, dict]:
            out = tmp / "hidden.safetensors"
            started = time.perf_counter()
            hidden = settings_from_sections(
                HiddenSettings, hidden={**base, **settings}, target={"path": str(target)}
            )
            summary = extract_hidden_states(
                tokens=tmp / "tokens.parquet", out=out, settings=hidden, model=model
            )
            return time.perf_counter() - started, summary

        # warm up both paths once
        bare_forward(model, frame.head(4), args.max_batch_tokens)
        stage(dtype="bf16")
        best = {"bare": float("inf"), "stage": float("inf"), "stage_forward": float("inf")}
        for _ in range(args.rounds):
            best["bare"] = min(best["bare"], bare_forward(model, frame, args.max_batch_tokens))
            seconds, summary = stage(dtype="bf16")
            best["stage"] = min(best["stage"], seconds)
            best["stage_forward"] = min(best["stage_forward"], summary["forward_seconds"])
        results = {
            "target": str(args.target or "untrained demo architecture"),
            "hidden_size": hidden,
            "num_layers": model.config.num_hidden_layers,
            "samples": args.samples,
            "threads": args.threads,
            "tokens": n_tokens,
            "bare_tokens_per_s": n_tokens / best["bare"],
            "stage_tokens_per_s": n_tokens / best["stage"],
            "ratio_stage_vs_bare": best["bare"] / best["stage"],
            "hook_forward_vs_bare": best["bare"] / best["stage_forward"],
            "pickle_baseline_bytes_per_token": 8 * hidden,
        }
        for name, settings in {
            "bf16_final_hidden": {"dtype": "bf16"},
            "fp8_final_hidden": {"dtype": "fp8"},
            "fp8_topk32": {"dtype": "fp8", "target_signal": "topk", "top_k": 32},
        }.items():
            _, summary = stage(**settings)
            results[f"bytes_per_token_{name}"] = summary["bytes_per_token"]
            results[f"ratio_to_pickle_{name}"] = summary["bytes_per_token"] / (8 * hidden)
        if args.vllm_python and Path(args.vllm_python).exists():
            results.update(vllm_backend(args, tmp, target, base, results, best["stage_forward"]))
            if args.shards:
                results["whole_run_capture"] = whole_run_capture(args, tmp, target, base, frame)
        results["kimi_k2_5_projection"] = kimi_projection(args)

    print(f"bare forward : {results['bare_tokens_per_s']:10.0f} tokens/s")
    print(f"stage        : {results['stage_tokens_per_s']:10.0f} tokens/s  "
          f"ratio {results['ratio_stage_vs_bare']:.3f} (goal >= 0.9); hooked forward alone "
          f"{results['hook_forward_vs_bare']:.3f}")  # fmt: skip
    print(f"bytes/token  : 8*H pickle baseline {8 * hidden}")
    for name in ("bf16_final_hidden", "fp8_final_hidden", "fp8_topk32"):
        print(f"  {name:18s} {results[f'bytes_per_token_{name}']:8.1f}  "
              f"({results[f'ratio_to_pickle_{name}']:.2f} x 8H)")  # fmt: skip
    if "vllm_tokens_per_s" in results:
        print(f"vLLM backend : {results['vllm_generate_tokens_per_s']:10.0f} tokens/s in generate, "
              f"{results['ratio_vllm_generate_vs_stage_forward']:.2f} x the transformers forward; "
              f"whole job {results['vllm_tokens_per_s']:.0f} tokens/s with the engine start, "
              f"{results['ratio_vllm_job_vs_stage']:.3f} x the transformers stage")  # fmt: skip
    else:
        print(f"vLLM backend : skipped (no interpreter at {args.vllm_python!r}; `make vllm`)")
    if "whole_run_capture" in results:
        run = results["whole_run_capture"]
        for way in ("per_shard", "server"):
            r = run[way]
            print(f"whole capture, {run['shards']} shards, {way:9s}: {r['seconds']:6.1f} s, "
                  f"{r['tokens_per_s']:7.0f} tokens/s, {r['engine_starts']} engine starts of "
                  f"{r['engine_start_s']:.1f} s, {r['capture_s']:.1f} s besides")  # fmt: skip
        print(f"  one server: {run['speedup_server_vs_per_shard']:.2f} x faster")
    kimi = results["kimi_k2_5_projection"]
    print(f"Kimi-K2.5 projection ({kimi['shards']} shards, {kimi['tokens'] / 1e6:.0f}M tokens, "
          f"{kimi['load_s_per_start']:.0f} s a start, capture {kimi['capture_h']:.1f} h): "
          f"engine per shard {kimi['per_shard_starts']:.0f} starts, {kimi['per_shard_h']:.1f} h; "
          f"one server 1 start, {kimi['server_h']:.1f} h")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
