"""The demo target's held-out check: greedy completions of held-out prompts, the share that
reason in a well-formed think block (and answer right), and the build's failure when too few do."""

from __future__ import annotations

from typing import Any

from eaglenest.common.reasoning import split_think
from eaglenest.demo.tasks import (
    END_OF_TURN,
    PAD_TOKEN,
    DemoExample,
    check_answer,
    is_well_formed,
)

MAX_NEW_TOKENS = 128


def generate_completions(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    batch_size: int = 64,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[str]:
    """Greedy completions (decoded with special tokens kept) for user `prompts`."""
    import torch

    eos_ids = [
        tokenizer.convert_tokens_to_ids(END_OF_TURN),
        tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    ]
    pad_id = eos_ids[1]
    completions: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chats = [[{"role": "user", "content": p}] for p in prompts[start : start + batch_size]]
        rendered = [
            tokenizer.apply_chat_template(
                c, add_generation_prompt=True, enable_thinking=True, tokenize=False
            )
            for c in chats
        ]
        inputs = tokenizer(
            rendered,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        )
        with torch.inference_mode():
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_ids,
                pad_token_id=pad_id,
            )
        for row in output[:, inputs["input_ids"].shape[1] :].tolist():
            # Rows that stopped early are padded to the longest one: cut after the first eos.
            stop = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
            completions.append(tokenizer.decode(row[:stop], skip_special_tokens=False))
    return completions


def evaluate_model(
    model: Any,
    tokenizer: Any,
    examples: list[DemoExample],
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> dict[str, Any]:
    """Share of well-formed think blocks and of correct answers, overall and per family."""
    prompts = [e.prompt for e in examples]
    # Long answers one at a time: a batch would pad every row to the longest answer.
    batch_size = 64 if max_new_tokens <= MAX_NEW_TOKENS else 1
    completions = generate_completions(
        model, tokenizer, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens
    )
    well_formed, correct, reasoned, lengths = [], [], [], []
    per_family: dict[str, list[bool]] = {e.family: [] for e in examples}
    for example, completion in zip(examples, completions):
        ok_form = is_well_formed(completion)
        lengths.append(len(tokenizer(completion, add_special_tokens=False)["input_ids"]))
        reasoning, content = split_think(completion)
        reasoned.append(bool(reasoning and reasoning.strip()))
        if content is not None:
            content = content.split(END_OF_TURN)[0]
        ok_answer = ok_form and check_answer(example, content)
        well_formed.append(ok_form)
        correct.append(ok_answer)
        per_family[example.family].append(ok_answer)
    n = max(1, len(examples))
    return {
        "heldout_prompts": len(examples),
        "well_formed_share": sum(well_formed) / n,
        "reasoning_share": sum(reasoned) / n,
        "correct_share": sum(correct) / n,
        "completion_tokens": lengths,
        "correct_share_per_family": {
            family: (sum(v) / len(v) if v else None) for family, v in per_family.items()
        },
        "sample_completions": [
            {"prompt": e.prompt, "completion": c} for e, c in list(zip(examples, completions))[:5]
        ],
    }


class DemoTargetError(RuntimeError):
    """The demo target was built but cannot stand in for a reasoning model."""


def check_reasoning_share(metrics: dict[str, Any], minimum: float, train_steps: int) -> None:
    """Fail the build when too few held-out prompts get reasoning: every later stage (and the
    probe first) would stop on such a target, after minutes of work instead of now."""
    share = metrics["reasoning_share"]
    if share >= minimum:
        return
    n = metrics["heldout_prompts"]
    examples = "; ".join(repr(s["completion"][:120]) for s in metrics["sample_completions"][:2])
    raise DemoTargetError(
        f"the demo target answered {round(share * n)} of {n} held-out prompts with a non-empty "
        f"think block (share {share:.2f} < demo_target.min_reasoning_share {minimum}); it does "
        f"not reason reliably yet. Raise demo_target.train_steps (now {train_steps}) or change "
        f"demo_target.seed. First completions: {examples}"
    )
