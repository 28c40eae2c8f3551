"""The collapsing demo's target build (`demo_target.tasks: cite`): write it (cite_target.py), then
prove it, teacher-forced: over whole check answers, the target's argmax at every position is the
rule's next token, so greedy decoding writes the rule's answer, token for token (an answer is
3 (states - 1) tokens and more: a forward pass proves at once what decoding would take minutes
to show)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.common.io import write_json
from eaglenest.demo.cite_target import write_cite_target
from eaglenest.demo.cite_tasks import (
    CITE_RULE_FILE,
    CiteShape,
    answer_text,
    cite_check_examples,
    rule_of,
    shape_of,
)
from eaglenest.demo.example import DemoExample

if TYPE_CHECKING:  # annotations only: the settings room lies above the demo's
    from eaglenest.settings.demo_target import DemoTargetSettings


def answer_ids(tokenizer: Any, example: DemoExample) -> tuple[list[int], int]:
    """(prompt + the rule's whole answer as ids, the prompt's length), with thinking on."""
    chat = [{"role": "user", "content": example.prompt}]
    prompt = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, enable_thinking=True, tokenize=False
    )
    ids = tokenizer(prompt + answer_text(example), add_special_tokens=False)["input_ids"]
    return ids, len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def teacher_forced(model: Any, tokenizer: Any, examples: list[DemoExample]) -> dict[str, Any]:
    """Per example: the answer's tokens, the positions where the target's argmax is not the
    rule's next token (none: greedy decoding writes the rule's answer), the smallest margin
    of the right token's logit over the best other one, and the right token's smallest
    probability at temperature 1 (a top_p below it samples the right token alone)."""
    import torch

    checked = []
    for example in examples:
        ids, prompt_len = answer_ids(tokenizer, example)
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, prompt_len - 1 : -1]
        gold = torch.tensor(ids[prompt_len:])
        wrong = (logits.argmax(-1) != gold).nonzero().flatten().tolist()
        right = logits.gather(1, gold[:, None])[:, 0]
        others = logits.scatter(1, gold[:, None], float("-inf")).max(-1).values
        checked.append(
            {
                "answer_tokens": len(gold),
                "wrong_positions": wrong[:20],
                "wrong": len(wrong),
                "min_margin": float((right - others).min()),
                "min_right_probability": float(
                    logits.double().log_softmax(-1).gather(1, gold[:, None]).exp().min()
                ),
            }
        )
    return {"examples": checked}


def write_cite(settings: DemoTargetSettings, threads: int, say: Callable[[str], None]) -> tuple:
    """(model, tokenizer, metrics) of the cite target, proven on `heldout_prompts` answers."""
    started = time.perf_counter()
    shape: CiteShape = shape_of(settings.cite)
    model, tokenizer, _ = write_cite_target(
        shape, settings.vocab_size, settings.max_position_embeddings, settings.seed
    )
    tokenizer.model_max_length = max(tokenizer.model_max_length, settings.max_position_embeddings)
    written_s = time.perf_counter() - started
    say(
        f"demo target (qwen3, written for the cite tasks: {shape.states} states, "
        f"{shape.words} words): {len(tokenizer)} tokens, in {written_s:.1f} s"
    )
    started = time.perf_counter()
    examples = cite_check_examples(shape, settings.heldout_prompts)
    check = teacher_forced(model, tokenizer, examples)
    exact = [e["wrong"] == 0 for e in check["examples"]]
    longest = max(e["answer_tokens"] for e in check["examples"])
    if longest + 64 > settings.max_position_embeddings:
        raise ValueError(
            f"demo_target.max_position_embeddings {settings.max_position_embeddings} is below "
            f"the cite answers' length ({longest} tokens and the prompt): raise it"
        )
    if not all(exact):
        raise RuntimeError(f"the written cite target is not exact on its check answers: {check}")
    share = sum(exact) / len(exact)
    metrics = {
        "heldout_prompts": len(examples),
        # Teacher-forced exactness at every position: a greedy decoding is the rule's answer,
        # so well-formed, reasoning and correct alike.
        "well_formed_share": share,
        "reasoning_share": share,
        "correct_share": share,
        "completion_tokens": [e["answer_tokens"] for e in check["examples"]],
        "teacher_forced": check,
        "architecture": "qwen3",
        "written": True,
        "seed": settings.seed,
        "train_steps": 0,
        "write_seconds": written_s,
        "eval_seconds": time.perf_counter() - started,
        "threads": threads,
    }
    say(
        f"cite target exact on {len(exact)} whole answers of up to {longest} tokens "
        f"(smallest margin {min(e['min_margin'] for e in check['examples']):.1f}, the right "
        f"token's probability at temperature 1 at least "
        f"{min(e['min_right_probability'] for e in check['examples']):.6f})"
    )
    return model, tokenizer, metrics


def write_cite_rule(directory: Path, settings: DemoTargetSettings, metrics: dict) -> None:
    """CITE_RULE_FILE beside the saved weights: the shape and seed the target was written for, and
    how sure it is of the rule's tokens, so that `eaglenest serve --rule` answers as the target
    would without running it."""
    checked = metrics["teacher_forced"]["examples"]
    sure = min(e["min_right_probability"] for e in checked)
    write_json(directory / CITE_RULE_FILE, rule_of(shape_of(settings.cite), settings.seed, sure))
