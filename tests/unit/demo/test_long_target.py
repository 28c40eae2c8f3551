"""The long demo's written target (demo/long_target.py) walks its chains exactly: the LM head
tells every two states apart, the previous-token head finds one position back at any depth of the
context, and the model predicts every token of a walk (teacher-forced over two thousand tokens,
and decoded greedily through transformers' generate), and its features hold the next four states
at every position of a walk (what the drafter families read to draft several tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eaglenest.common.reasoning import THINK_END, THINK_START
from eaglenest.demo.long_target import (
    AHEAD,
    HEAD_DIM,
    LOOKAHEAD,
    PREV_PLANES,
    PREV_SCALE,
    ROPE_THETA,
    SLOTS,
    fourier,
    frequencies,
    write_long_target,
)
from eaglenest.demo.long_tasks import STATES, chain_example
from eaglenest.demo.tasks import END_OF_TURN

CONTEXT = 12_288  # past the longest sample (about 9,050 tokens)


@pytest.fixture(scope="module")
def target():
    return write_long_target(300, CONTEXT)


def chat_ids(tokenizer, example) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of an example as the target should say it."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": example.prompt}], tokenize=False, add_generation_prompt=True
    )
    answer = f"{THINK_START}{example.reasoning}{THINK_END}\n\n{example.answer}{END_OF_TURN}"
    return tokenizer(prompt)["input_ids"], tokenizer(answer)["input_ids"]


def test_the_lm_head_tells_every_two_states_apart_by_a_wide_margin():
    features = fourier(np.arange(STATES), frequencies())
    scores = features @ features.T[:, :64]  # the first 64 states against all
    right = scores[np.arange(64), np.arange(64)]
    scores[np.arange(64), np.arange(64)] = -np.inf
    assert (scores.max(axis=0) < 0.41 * right).all()


def test_the_previous_token_head_attends_one_back_at_every_depth():
    theta = ROPE_THETA ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    distance = np.arange(CONTEXT)
    scores = PREV_SCALE * np.cos(np.outer(1 - distance, theta[:PREV_PLANES])).sum(axis=1)
    for depth in (2, 100, 2_000, CONTEXT - 1):
        seen = scores[: depth + 1]
        weights = np.exp(seen - seen.max())
        assert weights.argmax() == 1 and weights[1] / weights.sum() > 0.9999


def test_the_target_predicts_every_token_of_a_walk_of_two_thousand_states(target):
    model, tokenizer = target
    prompt, answer = chat_ids(tokenizer, chain_example(5, 2_000))
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        predicted = model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
    assert predicted.tolist() == answer


@pytest.mark.parametrize("key", [3, 6])
def test_the_eagle3_features_hold_the_next_lookahead_states_at_every_position(target, key):
    """Aux layer 4 (layer 3's output) holds OUT ... OUT4: each scored as the LM head scores OUT,
    its best state is the token j steps on at every position of a walk, which is what a
    drafter's j-th draft step reads; aux layer 3 (layer 2's output) holds the next state only."""
    model, tokenizer = target
    prompt, answer = chat_ids(tokenizer, chain_example(key, 300))
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    out = SLOTS["OUT"]
    head = model.lm_head.weight[:, out.start : out.stop]
    # after `<think>\n`, while the states j steps on are still states
    walk = slice(len(prompt) + 2, len(prompt) + 300 - LOOKAHEAD)
    assert len(AHEAD) == LOOKAHEAD == 4
    for j, name in enumerate(AHEAD, start=1):
        ahead = (hidden[4][0][:, SLOTS[name]] @ head.T).argmax(-1)
        assert ahead[walk].tolist() == ids[0, walk.start + j : walk.stop + j].tolist(), name
    assert hidden[3][0][:, SLOTS["OUT2"]].abs().max() == 0  # layer 3 writes them


def test_greedy_decoding_writes_the_walk_and_stops(target):
    model, tokenizer = target
    for key, length in ((0, 3), (7, 120)):
        prompt, answer = chat_ids(tokenizer, chain_example(key, length))
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=len(answer) + 10,
            do_sample=False,
            eos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TURN),
        )
        assert out[0, len(prompt) :].tolist() == answer
