"""Build the embedded demo target: a tiny Qwen3-architecture reasoning model trained on CPU.

The demo pipeline needs a target that behaves like a real reasoning model where it matters to
eaglenest: its own byte-level BPE tokenizer with Qwen's pre-tokenizer, `<think>`/`</think>` as
single added tokens, a Qwen3-style chat template, and completions of the form
`<think>\\n...\\n</think>\\n\\nanswer<|im_end|>`. It is trained here from scratch on the synthetic
tasks of `eaglenest.demo.tasks` for a fixed number of steps (deterministic for a seed), evaluated
on held-out prompts, and saved in Hugging Face layout so the server, the tokenizer-based stages
and the hidden-state stage load it like any other checkpoint.

This module runs the build (`build_demo_target`, `eaglenest build-demo-target`); its parts are
target_tokenizer.py, target_model.py (Qwen3 or DeepSeek-V3), target_training.py and
target_heldout.py (the check that the trained target reasons).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eaglenest.common.config import settings_from_sections
from eaglenest.common.io import held_temp_beside, write_json
from eaglenest.demo.kimi_layout import LAYOUTS, wrap_kimi_k25
from eaglenest.demo.long_target import write_long_target
from eaglenest.demo.long_tasks import check_examples
from eaglenest.demo.target_heldout import check_reasoning_share, evaluate_model
from eaglenest.demo.target_model import ARCHITECTURES, make_model
from eaglenest.demo.target_tokenizer import (
    THINK_TOKENS,
    TOKENIZER_CORPUS_EXAMPLES,
    build_demo_tokenizer,
    tokenizer_corpus,
)
from eaglenest.demo.target_training import train_model
from eaglenest.demo.tasks import (
    END_OF_TURN,
    PAD_TOKEN,
    TASK_SUITES,
    DemoExample,
    heldout_examples,
    training_examples,
)
from eaglenest.settings.demo_target import DemoTargetSettings

logger = logging.getLogger(__name__)

DEMO_METRICS_FILE = "demo_metrics.json"


def _save(model: Any, tokenizer: Any, directory: Path, max_new_tokens: int) -> None:
    from transformers import GenerationConfig

    eos_ids = [
        tokenizer.convert_tokens_to_ids(END_OF_TURN),
        tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    ]
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[1],
        do_sample=False,
        max_new_tokens=max_new_tokens,
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Use `threads` torch threads (else $EAGLENEST_THREADS, else torch's current setting) for
    the block, then restore the previous setting so a caller's process (a test session, say)
    is left as it was. Yields the number in use."""
    import torch

    previous = torch.get_num_threads()
    wanted = threads or int(os.environ.get("EAGLENEST_THREADS") or 0) or previous
    torch.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; it replaces `path` only if the block succeeds,
    so a killed or failed build never leaves a directory that looks complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Made like mkdir makes it (mkdtemp: 0700); stale ones of killed builds are removed first.
    with held_temp_beside(path, directory=True) as tmp:
        try:
            yield tmp
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)


def _parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def _train_and_evaluate(
    model: Any,
    tokenizer: Any,
    examples: list[DemoExample],
    *,
    seed: int,
    train_steps: int,
    batch_size: int,
    learning_rate: float,
    window_tokens: int | None,
    heldout: list[DemoExample],
    heldout_max_new_tokens: int,
    threads: int,
) -> dict[str, Any]:
    """Train `model` on `examples`, evaluate it on `heldout_prompts` held-out prompts; return the
    evaluation's metrics and how the target was made (seed, steps, parameters, final loss,
    seconds, threads, think token ids)."""
    train_started = time.perf_counter()
    final_loss = train_model(
        model,
        tokenizer,
        examples,
        train_steps=train_steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        window_tokens=window_tokens,
    )
    train_seconds = time.perf_counter() - train_started
    eval_started = time.perf_counter()
    metrics = evaluate_model(model, tokenizer, heldout, heldout_max_new_tokens)
    metrics.update(
        architecture=model.config.model_type,
        seed=seed,
        train_steps=train_steps,
        batch_size=batch_size,
        n_params=_parameter_count(model),
        final_loss=final_loss,
        train_seconds=train_seconds,
        eval_seconds=time.perf_counter() - eval_started,
        threads=threads,
        think_token_ids=[tokenizer.convert_tokens_to_ids(t) for t in THINK_TOKENS],
    )
    return metrics


def check_layout(settings: DemoTargetSettings) -> None:
    """Refuses a layout the architecture (or the long tasks' written target) cannot take."""
    written = settings.tasks in ("long", "cite")
    if written and (settings.architecture, settings.layout) != ("qwen3", "plain"):
        raise ValueError(
            f"demo_target.tasks {settings.tasks} writes a Qwen3 target (demo/long_target.py, "
            "demo/cite_target.py): set "
            "demo_target.architecture qwen3 and layout plain"
        )
    if settings.layout == "kimi_k25" and settings.architecture != "deepseek_v3":
        raise ValueError(
            "demo_target.layout kimi_k25 wraps a DeepSeek-V3 text model, as Kimi-K2.5 does: "
            f"set demo_target.architecture deepseek_v3 (not {settings.architecture!r})"
        )


def _train_short(settings: DemoTargetSettings, threads: int, say: Callable[[str], None]) -> tuple:
    """(model, tokenizer, metrics) of a target trained on the short tasks."""
    import torch

    seed, train_steps, batch_size = settings.seed, settings.train_steps, settings.batch_size
    torch.manual_seed(seed)
    examples = training_examples(seed, train_steps * batch_size, settings.tasks)
    tokenizer = build_demo_tokenizer(
        tokenizer_corpus(examples[:TOKENIZER_CORPUS_EXAMPLES]), settings.vocab_size
    )
    model = make_model(
        tokenizer,
        architecture=settings.architecture,
        deepseek_v3=settings.deepseek_v3,
        vocab_size=settings.vocab_size,
        num_layers=settings.num_layers,
        hidden_size=settings.hidden_size,
        num_heads=settings.num_heads,
        num_kv_heads=settings.num_kv_heads,
        intermediate_size=settings.intermediate_size,
        max_position_embeddings=settings.max_position_embeddings,
    )
    tokenizer.model_max_length = max(tokenizer.model_max_length, settings.max_position_embeddings)
    say(
        f"demo target ({settings.architecture}): {len(tokenizer)} tokens, "
        f"{_parameter_count(model)} parameters; "
        f"{train_steps} steps of {batch_size} examples on {threads} threads"
    )
    metrics = _train_and_evaluate(
        model,
        tokenizer,
        examples,
        seed=seed,
        train_steps=train_steps,
        batch_size=batch_size,
        learning_rate=settings.learning_rate,
        window_tokens=settings.train_window_tokens,
        heldout=heldout_examples(seed, settings.heldout_prompts, settings.tasks),
        heldout_max_new_tokens=settings.heldout_max_new_tokens,
        threads=threads,
    )
    return model, tokenizer, metrics


def _write_long(settings: DemoTargetSettings, threads: int, say: Callable[[str], None]) -> tuple:
    """(model, tokenizer, metrics) of the long tasks' written target, decoded on check prompts
    (walks of a few hundred to 1,500 states: the held-out check of a trained target, sized to
    take a minute; the depths past them are checked by the tests and by vLLM in the run)."""
    started = time.perf_counter()
    model, tokenizer = write_long_target(settings.vocab_size, settings.max_position_embeddings)
    tokenizer.model_max_length = max(tokenizer.model_max_length, settings.max_position_embeddings)
    written_s = time.perf_counter() - started
    say(
        f"demo target (qwen3, written for the long tasks): {len(tokenizer)} tokens, "
        f"{_parameter_count(model)} parameters, in {written_s:.1f} s"
    )
    started = time.perf_counter()
    check = check_examples(settings.heldout_prompts)
    metrics = evaluate_model(model, tokenizer, check, settings.heldout_max_new_tokens)
    metrics.update(
        architecture="qwen3",
        written=True,
        seed=settings.seed,
        train_steps=0,
        n_params=_parameter_count(model),
        write_seconds=written_s,
        eval_seconds=time.perf_counter() - started,
        threads=threads,
        think_token_ids=[tokenizer.convert_tokens_to_ids(t) for t in THINK_TOKENS],
    )
    return model, tokenizer, metrics


def build_demo_target(
    out_dir: str | Path,
    settings: DemoTargetSettings,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build, train (or write: `tasks` long, demo/long_target.py), evaluate and save the demo
    target to `out_dir`; return its metrics.

    The schema's defaults (the `demo_target` section) train on 9,600 examples: about 2 minutes on
    two idle cores (~85 examples/s), after which held-out completions are well-formed think
    blocks. The directory appears only when complete, and replaces an existing one. `threads`:
    see `torch_threads`; in a pipeline job the adapter has already set the rule's threads.
    `architecture`: qwen3 (dense) or deepseek_v3 (MLA + MoE, sized by `deepseek_v3` over
    DEEPSEEK_V3_DEFAULTS; `num_kv_heads` unused). `layout` kimi_k25 saves it wrapped as
    Kimi-K2.5 (eaglenest.demo.kimi_layout).
    """
    say = log or logger.info
    check_layout(settings)  # before the training, not after it
    started = time.perf_counter()
    with torch_threads(threads) as threads_used:
        if settings.tasks == "long":
            model, tokenizer, metrics = _write_long(settings, threads_used, say)
        elif settings.tasks == "cite":
            from eaglenest.demo.cite_build import write_cite

            model, tokenizer, metrics = write_cite(settings, threads_used, say)
        else:
            model, tokenizer, metrics = _train_short(settings, threads_used, say)
    say(
        f"held-out: well-formed {metrics['well_formed_share']:.2f}, "
        f"reasoning {metrics['reasoning_share']:.2f}, "
        f"correct {metrics['correct_share']:.2f}"
        + (f", final loss {metrics['final_loss']:.3f}" if "final_loss" in metrics else "")
    )
    check_reasoning_share(metrics, settings.min_reasoning_share, metrics["train_steps"])
    with atomic_directory(Path(out_dir)) as tmp_dir:
        _save(model, tokenizer, tmp_dir, settings.heldout_max_new_tokens)
        if settings.tasks == "cite":
            from eaglenest.demo.cite_build import write_cite_rule

            write_cite_rule(tmp_dir, settings, metrics)
        if settings.layout == "kimi_k25":
            wrap_kimi_k25(tmp_dir, tmp_dir)
            say("saved in Kimi-K2.5's layout (KimiK25ForConditionalGeneration)")
        metrics["total_seconds"] = time.perf_counter() - started
        write_json(tmp_dir / DEMO_METRICS_FILE, metrics)
    say(f"demo target written to {out_dir} in {metrics['total_seconds']:.0f} s")
    return metrics


INT_OPTIONS = (
    "seed",
    "train-steps",
    "batch-size",
    "num-layers",
    "hidden-size",
    "num-heads",
    "num-kv-heads",
    "intermediate-size",
    "vocab-size",
    "max-position-embeddings",
    "heldout-prompts",
    "heldout-max-new-tokens",
    "train-window-tokens",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory (Hugging Face layout)")
    # Unset options take the `demo_target` section's defaults (config/schema.yaml).
    for name in INT_OPTIONS:
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--architecture", choices=ARCHITECTURES)
    parser.add_argument("--layout", choices=LAYOUTS, help="plain, or kimi_k25 (deepseek_v3)")
    parser.add_argument("--tasks", choices=TASK_SUITES)
    parser.add_argument(
        "--min-reasoning-share",
        type=float,
        help="fail when fewer held-out answers than this reason (0 turns the check off)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: $EAGLENEST_THREADS, else all cores)",
    )


def run(args: argparse.Namespace) -> int:
    fields = [
        f for f in DemoTargetSettings.__dataclass_fields__ if f not in ("deepseek_v3", "cite")
    ]
    given = {k: getattr(args, k) for k in fields if getattr(args, k) is not None}
    settings = settings_from_sections(DemoTargetSettings, demo_target=given)
    build_demo_target(args.out, settings, threads=args.threads)
    return 0
