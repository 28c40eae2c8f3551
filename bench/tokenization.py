"""Tokenize stage benchmark: tokens/s of the stage against the tokenizer's own batch encode.

The stage's rebuild path renders each prompt with the chat template, tokenizes prompts,
reasonings and contents in one batched call per chunk, inserts think and end-of-turn ids, decodes
the pieces back to check them, counts loss tokens and builds the frame. The baseline is the
tokenizer's batch encode of the same full texts (prompt + <think> + reasoning + </think> + content
+ end of turn, already rendered); "render + encode" also pays the chat template, as the stage
does. Goal: ratio >= 0.8 when rebuilding. The server-id path (ids given) is measured with and
without the rebuild check (`tokenize.verify_rebuild`). Variants alternate round by round and the
best round of each counts, so a change in the machine's load does not skew the ratios.

Samples are demo-task answers; `--reasoning-repeat K` chains K reasonings into one, for the
lengths real reasoning models write (hundreds to thousands of tokens). Uses the demo tokenizer
(trained here in a second, no model) unless `--tokenizer DIR` names another.

Usage: python bench/tokenization.py [--samples 3000] [--reasoning-repeat 1 16 64] [--json out.json]
"""

from __future__ import annotations

# Named tokenization.py, not tokenize.py: every script in bench/ has this folder first on
# sys.path, where a tokenize.py would shadow the standard library module of that name.
import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import polars as pl

from eaglenest.common.config import settings_from_sections
from eaglenest.demo.target_tokenizer import build_demo_tokenizer, tokenizer_corpus
from eaglenest.demo.tasks import heldout_examples, training_examples
from eaglenest.formats.samples import SAMPLE_SCHEMA
from eaglenest.settings.samples import TokenizeSettings
from eaglenest.stages.samples.tokenize import tokenize_frame
from eaglenest.target_model.special_tokens import resolve_target_tokens
from eaglenest.target_model.tokenizer import load_tokenizer, think_token_ids

KWARGS = {"enable_thinking": True}


def make_samples(n: int, repeat: int) -> list[dict]:
    examples = heldout_examples(seed=1, n=n + repeat)
    rows = []
    for i in range(n):
        chain = examples[i : i + repeat]
        reasoning = "".join(e.reasoning for e in chain)
        messages = [{"role": "user", "content": examples[i].prompt}]
        rows.append(
            {
                "id": hashlib.sha256(f"{i}".encode()).hexdigest()[:16],
                "messages": messages,
                "reasoning": reasoning,
                "content": "\n\n" + examples[i].answer,
                "reasoning_field": "reasoning",
                "finish_reason": "stop",
                "request": json.dumps({"chat_template_kwargs": KWARGS, "messages": messages}),
                "endpoint": "bench",
                "latency_s": 0.0,
            }
        )
    return rows


def full_texts(tokenizer, rows: list[dict]) -> tuple[list[str], list[str]]:
    prompts = [
        tokenizer.apply_chat_template(
            r["messages"], add_generation_prompt=True, tokenize=False, **KWARGS
        )
        for r in rows
    ]
    completions = [f"<think>{r['reasoning']}</think>{r['content']}<|im_end|>" for r in rows]
    return prompts, completions


def best_times(runs: int, variants: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Best wall time of each variant over `runs` rounds; every round runs each variant once, so
    a change in the machine's load between variants does not skew their ratio."""
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(runs):
        for name, fn in variants.items():
            started = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def bench(tokenizer_dir: Path, n: int, repeat: int, runs: int) -> dict:
    target = {"path": str(tokenizer_dir), "chat_template_kwargs": KWARGS}
    default_settings = settings_from_sections(TokenizeSettings, target=target)
    tokenizer = load_tokenizer(default_settings.target)
    think_ids = think_token_ids(str(tokenizer_dir))  # as the probe writes them to probe.json
    tokens = resolve_target_tokens(tokenizer, think_ids, default_settings)
    rows = make_samples(n, repeat)
    prompts, completions = full_texts(tokenizer, rows)
    texts = [p + c for p, c in zip(prompts, completions)]
    n_tokens = sum(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"]))
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    without_ids = pl.DataFrame(rows, schema=SAMPLE_SCHEMA)
    with_ids = without_ids.with_columns(
        pl.Series("prompt_token_ids", prompt_ids, dtype=pl.List(pl.Int64)),
        pl.Series("completion_token_ids", completion_ids, dtype=pl.List(pl.Int64)),
    )
    frame, _, _ = tokenize_frame(without_ids, tokenizer, tokens, default_settings, KWARGS)
    assert int(frame["n_tokens"].sum()) == n_tokens, "the rebuild must write the baseline's tokens"

    def stage(samples: pl.DataFrame, verify: bool) -> Callable[[], object]:
        settings = replace(default_settings, max_length=None, verify_rebuild=verify)
        return lambda: tokenize_frame(samples, tokenizer, tokens, settings, KWARGS)

    variants = {
        "baseline": lambda: tokenizer(texts, add_special_tokens=False),
        "baseline_backend_fast": lambda: tokenizer.backend_tokenizer.encode_batch_fast(
            texts, add_special_tokens=False
        ),
        "baseline_render_and_encode": lambda: tokenizer(
            [p + c for p, c in zip(full_texts(tokenizer, rows)[0], completions)],
            add_special_tokens=False,
        ),
        "rebuild": stage(without_ids, True),
        "server_ids": stage(with_ids, False),
        "server_ids_verified": stage(with_ids, True),
    }
    with open(os.devnull, "w") as quiet:
        stderr, sys.stderr = sys.stderr, quiet  # the stage's progress bars
        try:
            seconds = best_times(runs, variants)
        finally:
            sys.stderr = stderr
    _, _, verified = tokenize_frame(with_ids, tokenizer, tokens, default_settings, KWARGS)
    result = {
        "samples": n,
        "reasoning_repeat": repeat,
        "tokens": n_tokens,
        "tokens_per_sample": n_tokens / n,
        **{f"{name}_tokens_per_s": n_tokens / s for name, s in seconds.items()},
        "agreement_share": verified.agreement.share,
    }
    for name in ("rebuild", "server_ids"):
        result[f"{name}_ratio"] = seconds["baseline"] / seconds[name]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--reasoning-repeat", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--runs", type=int, default=3, help="best of this many runs")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer dir (default: demo tokenizer)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = args.tokenizer
        if tokenizer_dir is None:
            tokenizer_dir = Path(tmp) / "demo-tokenizer"
            corpus = tokenizer_corpus(training_examples(0, 4000))
            build_demo_tokenizer(corpus, vocab_size=1024).save_pretrained(tokenizer_dir)
        results = [bench(tokenizer_dir, args.samples, k, args.runs) for k in args.reasoning_repeat]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    for r in results:
        print(
            f"{r['samples']} samples x {r['tokens_per_sample']:.0f} tokens: baseline "
            f"{r['baseline_tokens_per_s']:,.0f} tokens/s (backend encode_batch_fast "
            f"{r['baseline_backend_fast_tokens_per_s']:,.0f}, render + encode "
            f"{r['baseline_render_and_encode_tokens_per_s']:,.0f}); rebuild "
            f"{r['rebuild_tokens_per_s']:,.0f} tokens/s, ratio {r['rebuild_ratio']:.2f}; "
            f"server ids {r['server_ids_tokens_per_s']:,.0f} tokens/s, ratio "
            f"{r['server_ids_ratio']:.2f} ({r['server_ids_verified_tokens_per_s']:,.0f} with "
            f"verify_rebuild); agreement {r['agreement_share']}"
        )
    if args.json:
        figures = {
            "machine": {"processor": platform.processor() or platform.machine(),
                        "cpu_count": os.cpu_count()},
            "by_reasoning_repeat": {str(r["reasoning_repeat"]): r for r in results},
        }  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
