"""The long-reasoning demo's task (demo_target.tasks long, prompts.source demo-long): walks of
thousands of states, one token each, set by a key in the prompt; the short suite left as it was;
and training a target on windows of long answers, kept at their true positions."""

from __future__ import annotations

import random
import re
import statistics

import pytest
import torch

from eaglenest.demo.long_target import long_tokenizer
from eaglenest.demo.long_tasks import (
    END_STATE,
    KEYS,
    LONG_FAMILIES,
    STATES,
    STEPS,
    chain_example,
    key_token,
    start_for,
    walk,
)
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


def test_long_answers_have_a_median_above_2048_tokens_and_some_above_8192():
    tokenizer = long_tokenizer(300)
    examples = heldout_examples(0, 120, "long")
    lengths = [len(tokenizer(e.reasoning)["input_ids"]) for e in examples]
    assert statistics.median(lengths) >= 2048
    assert sum(n >= 8192 for n in lengths) >= 10
    prompts = [len(tokenizer(e.prompt)["input_ids"]) for e in examples]
    assert max(lengths) + max(prompts) < 9_200  # inside the long demo's context
    assert {e.family for e in examples} == set(LONG_FAMILIES)
    # A state is one token, and the walk's text splits back into its states alone.
    example = examples[0]
    ids = tokenizer(example.reasoning)["input_ids"]
    assert tokenizer.decode(ids) == example.reasoning
    assert tokenizer.convert_ids_to_tokens(ids[1:-1]) == re.findall(r"s\d{5}", example.reasoning)


def test_a_walk_steps_by_its_keys_step_and_ends_before_the_end_state():
    for key in range(KEYS):
        for length in (1, 37, 600):
            start = start_for(key, length)
            states = walk(key, start)
            assert len(states) == length and END_STATE not in states
            assert (states[-1] + STEPS[key]) % STATES == END_STATE
            assert states[0] == (start + STEPS[key]) % STATES
    example = chain_example(3, 5)
    assert key_token(3) in example.prompt and example.answer == key_token(3)
    assert example.reasoning.startswith("\n") and example.reasoning.endswith("\n")


def test_long_held_out_prompts_are_distinct_and_the_short_suite_is_unchanged():
    heldout = [e.prompt for e in heldout_examples(0, 200, "long")]
    assert len(set(heldout)) == 200
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
