"""The long-reasoning demo's tasks (demo_target.tasks long, prompts.source demo-long): answers of
thousands of tokens whose every token depends on one at a fixed offset (a round back, or the
prompt), held-out prompts never trained on, the short suite left as it was; and training on
windows of them, kept at their true positions."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from eaglenest.demo.long_tasks import BLOCK_NUMBERS, HELDOUT_ROUNDS, LINE_TOKENS, LONG_FAMILIES
from eaglenest.demo.target import long_curriculum
from eaglenest.demo.target_tokenizer import build_demo_tokenizer, tokenizer_corpus
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


def _demo_tokenizer():
    examples = training_examples(0, 300, "long")
    return build_demo_tokenizer(tokenizer_corpus(examples), 512)


def test_long_answers_have_a_median_above_2048_tokens_and_some_above_8192():
    tokenizer = _demo_tokenizer()
    examples = heldout_examples(0, 120, "long")
    lengths = [len(tokenizer(e.reasoning)["input_ids"]) for e in examples]
    assert statistics.median(lengths) >= 2048
    assert sum(n >= 8192 for n in lengths) >= 5
    prompts = [len(tokenizer(e.prompt)["input_ids"]) for e in examples]
    assert max(lengths) + max(prompts) < 14000  # inside the long demo target's context of 16,384
    assert {e.family for e in examples} == set(LONG_FAMILIES)


def test_every_prompt_and_every_line_has_one_length_so_what_a_token_needs_lies_at_a_fixed_offset():
    tokenizer = _demo_tokenizer()
    examples = heldout_examples(1, 8, "long") + training_examples(1, 8, "long")
    assert len({len(tokenizer(e.prompt)["input_ids"]) for e in examples}) == 1
    line_lengths = {
        len(tokenizer(line + "\n")["input_ids"])
        for e in examples
        for line in e.reasoning.strip("\n").split("\n")
    }
    assert line_lengths == {LINE_TOKENS}


def test_rounds_write_the_prompts_block_counting_the_rounds_left_down_to_one():
    for example in training_examples(3, 6, "long") + heldout_examples(3, 3, "long"):
        head, block = example.prompt.split(":", 1)
        rounds = int(head.removeprefix("Write the block ").removesuffix(" times"))
        lines = example.reasoning.strip("\n").split("\n")
        assert lines == [f"{r:03d}:{block}" for r in range(rounds, 0, -1)]
        assert len(block.split()) == BLOCK_NUMBERS and example.answer == block.split()[-1]


def test_training_draws_shorter_answers_than_the_held_out_prompts_too():
    def rounds(example):
        return len(example.reasoning.strip("\n").split("\n"))

    assert min(map(rounds, heldout_examples(0, 200, "long"))) >= HELDOUT_ROUNDS[0]
    assert min(map(rounds, training_examples(0, 200, "long"))) < HELDOUT_ROUNDS[0]


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


def test_the_curriculum_sorts_two_thirds_by_length_and_keeps_every_length_in_the_last_third():
    drawn = training_examples(0, 90, "long")
    ordered = list(drawn)
    long_curriculum(ordered)

    def length(example):
        return len(example.prompt) + len(example.reasoning)

    first = [length(e) for e in ordered[:60]]
    assert first == sorted(first) and sorted(first) == sorted(map(length, drawn[:60]))
    # The last steps still see short and long answers: sorted to the end, they saw only the
    # longest, and the target took their round counts as a prior.
    assert ordered[60:] == drawn[60:]
    last = [length(e) for e in ordered[60:]]
    assert min(last) < statistics.median(first) < max(last)
