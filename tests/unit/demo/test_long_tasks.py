"""The long-reasoning demo's tasks (demo_target.tasks long, prompts.source demo-long): answers of
thousands of tokens from three families, held-out prompts never trained on, the short suite left
as it was; and training on windows of them, kept at their true positions."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest
import torch

from eaglenest.demo.long_tasks import LONG_FAMILIES
from eaglenest.demo.target_training import (
    ANSWER_HEAD_TOKENS,
    WINDOW_CONTEXT_TOKENS,
    pad_rows,
    window_rows,
)
from eaglenest.demo.tasks import (
    TASK_FAMILIES,
    heldout_examples,
    suite_families,
    training_examples,
)


def test_long_answers_have_a_median_above_2048_characters_and_some_above_8192():
    # Digits, spaces and newlines are one token each in the demo tokenizer: characters ~ tokens.
    examples = heldout_examples(0, 120, "long")
    lengths = [len(e.prompt) + len(e.reasoning) + len(e.answer) for e in examples]
    assert statistics.median(lengths) >= 2048
    assert sum(n >= 8192 for n in lengths) >= 5
    assert max(lengths) < 14000  # inside the long demo target's context of 16,384
    assert {e.family for e in examples} == set(LONG_FAMILIES)


def test_each_line_of_a_count_follows_from_the_one_before_and_the_end_is_in_the_prompt():
    for example in training_examples(3, 6, "long")[:2]:
        lines = example.reasoning.strip("\n").split("\n")
        step = 1 if example.family == "count_up" else -1
        assert all(int(b) - int(a) == step for a, b in itertools.pairwise(lines))
        assert example.prompt.endswith(f"to {lines[-1]}.") and example.answer == lines[-1]


def test_a_copy_writes_the_prompts_list_as_many_rounds_as_asked():
    copy = next(e for e in training_examples(1, 9, "long") if e.family == "copy")
    listed = copy.prompt.removeprefix("Write the list ").rsplit(" ", 2)[0]
    rounds = int(copy.answer)
    lines = copy.reasoning.strip("\n").split("\n")
    assert lines == [x for r in range(1, rounds + 1) for x in (f"round {r}", listed)]


def test_long_held_out_prompts_are_never_trained_on_and_the_short_suite_is_unchanged():
    heldout = {e.prompt for e in heldout_examples(0, 200, "long")}
    assert not heldout & {e.prompt for e in training_examples(0, 2000, "long")}
    assert tuple(suite_families("short")) == TASK_FAMILIES
    assert training_examples(0, 5) == training_examples(0, 5, "short")
    with pytest.raises(ValueError, match="suite"):
        suite_families("medium")


def test_a_window_keeps_the_prompt_the_answers_head_and_a_stretch_at_their_true_positions():
    prompt_len, length, window = 10, 500, 64
    head_end = prompt_len + ANSWER_HEAD_TOKENS
    encoded = [(list(range(length)), prompt_len), (list(range(40)), 8)]
    starts = set()
    for seed in range(40):
        (ids, positions, trained), short = window_rows(encoded, window, random.Random(seed))
        # A short answer stays whole, trained from its first token.
        assert short == (list(range(40)), list(range(40)), [i >= 8 for i in range(40)])
        assert len(ids) == head_end + window and ids == positions  # ids here are positions
        assert positions[:head_end] == list(range(head_end))
        start = positions[head_end]
        assert positions[head_end:] == list(range(start, start + window))
        # The prompt is never trained on, the answer's head always is.
        assert trained[:head_end] == [i >= prompt_len for i in range(head_end)]
        detached = start > head_end
        assert trained[head_end:] == [
            not detached or j >= WINDOW_CONTEXT_TOKENS for j in range(window)
        ]
        starts.add(start)
    # Windows at the answer's end (where it stops) and anywhere between.
    assert length - window in starts and len(starts) > 5
    batch = pad_rows(window_rows(encoded, window, random.Random(0)), pad_id=0)
    assert batch["attention_mask"][1].sum() == 40 and (batch["labels"][1, :8] == -100).all()
    assert (batch["labels"][0, prompt_len:head_end] == torch.arange(prompt_len, head_end)).all()
    assert batch["position_ids"][0, head_end] >= head_end
