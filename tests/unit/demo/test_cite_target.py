"""The collapsing demo (demo_target.tasks cite): the rule of its answers, and a written target
whose greedy decoding follows it exactly, with the walk's next states in its features and the
recital's next two words, not the third."""

from __future__ import annotations

import random

import pytest
import torch

from eaglenest.demo.cite_build import answer_ids, teacher_forced
from eaglenest.demo.cite_target import (
    CITE_SLOTS,
    N_WORD_FREQ,
    W2_FREQ,
    describe,
    write_cite_target,
)
from eaglenest.demo.cite_tasks import (
    BOOK,
    RECITE,
    CiteShape,
    cite_examples,
    cite_reasoning,
    cite_start,
    draw_cite,
    word_token,
)
from eaglenest.demo.long_tasks import state_token

SHAPE = CiteShape(states=160, words=64, walk=(64, 150), book=(16, 32))


@pytest.fixture(scope="module")
def written():
    return write_cite_target(SHAPE, 300, 2048, seed=0)


def test_an_answer_walks_then_recites_the_book_two_words_a_state_until_the_walk_comes_round():
    book = [5, 9, 2]
    start = cite_start(SHAPE, key=3, walk=70)
    tokens = cite_reasoning(SHAPE, 3, start, book)
    first = tokens.index(RECITE)
    assert first == 70  # the walk's first phase
    assert all(t.startswith("s") for t in tokens[:first])
    phase2 = tokens[first + 1 : -1]
    assert tokens[-1] == RECITE and len(phase2) == 3 * (SHAPE.states - 1)
    assert phase2[0] == state_token(SHAPE.step(3))  # the next cycle starts after the end state
    words = [t for i, t in enumerate(phase2) if i % 3]
    cycle = [word_token(w) for w in book] + [BOOK]
    assert words[:8] == (cycle * 3)[:8]
    # The answer's length as the shape says (think tags, the separator, key and end of turn).
    assert SHAPE.answer_tokens(70) == 2 + len(tokens) + 1 + 1 + 1 + 1 + 1


def test_the_seed_draws_other_prompts_and_the_draws_are_repeatable():
    one = cite_examples(SHAPE, target_seed=0, seed=0, n=4)
    assert [e.prompt for e in one] == [e.prompt for e in cite_examples(SHAPE, 0, 0, 4)]
    assert [e.prompt for e in one] != [e.prompt for e in cite_examples(SHAPE, 1, 0, 4)]


def test_a_shape_the_walk_cannot_take_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="demo_target.cite.states"):
        CiteShape(states=150, words=64, walk=(1, 2), book=(2, 3))
    with pytest.raises(ValueError, match="demo_target.cite.walk"):
        CiteShape(states=160, words=64, walk=(10, 160), book=(2, 3))


def test_greedy_decoding_is_the_rule_at_every_position_of_whole_answers(written):
    model, tokenizer, _ = written
    examples = [draw_cite(SHAPE, random.Random(i)) for i in range(3)]
    checked = teacher_forced(model, tokenizer, examples)["examples"]
    assert [e["wrong"] for e in checked] == [0, 0, 0]
    assert min(e["min_margin"] for e in checked) > 5


def test_another_seed_writes_other_frequencies():
    _, tokenizer, target = write_cite_target(SHAPE, 300, 2048, seed=0)
    other = describe(SHAPE, tokenizer, seed=1)
    assert not (target.freqs == other.freqs).all()


def _hidden(model, ids):
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states  # hidden_states[k]: the input of layer k


def test_features_hold_the_walks_states_ahead_and_the_next_two_words_not_the_third(written):
    model, tokenizer, target = written
    example = draw_cite(SHAPE, random.Random(7))
    ids, prompt_len = answer_ids(tokenizer, example)
    aux = _hidden(model, ids)[4][0]  # the outputs of layer 3: OUT ... OUT4, OUTW, ATT_W, W2
    tokens = tokenizer.convert_ids_to_tokens(ids)
    states = target.state_features

    def slot(position: int, name: str) -> torch.Tensor:
        return aux[position, CITE_SLOTS[name]].double()

    def nearest_state(vector: torch.Tensor) -> int:
        scores = torch.tensor(states(target.states)) @ vector
        return int(target.states[int(scores.argmax())])

    words = torch.tensor(target.word_features(torch.arange(SHAPE.words).numpy()))
    assert words.shape[0] == SHAPE.words
    # W2 holds a word's first W2_FREQ frequencies.
    first = torch.cat([words[:, :W2_FREQ], words[:, N_WORD_FREQ : N_WORD_FREQ + W2_FREQ]], 1)

    def nearest_word(position: int, name: str) -> str:
        best = int(((first if name == "W2" else words) @ slot(position, name)).argmax())
        return word_token(best) if best else BOOK

    recite = tokens.index(RECITE, prompt_len)
    walk = prompt_len + 3  # a state of the first phase, far from its end
    for j, name in enumerate(["OUT2", "OUT3", "OUT4"], start=2):
        assert state_token(nearest_state(slot(walk, name))) == tokens[walk + j]
    # Phase 2, `n w w n' w w`: at the first word, OUT2 holds the next state, OUTW the next word
    # and W2 the word after it (the one after n'); no state slot holds a word.
    state = recite + 4
    assert tokens[state].startswith("s") and tokens[state + 1].startswith(("w", BOOK))
    assert state_token(nearest_state(slot(state + 1, "OUT2"))) == tokens[state + 3]
    assert nearest_word(state + 1, "OUTW") == tokens[state + 2]
    assert nearest_word(state + 1, "W2") == tokens[state + 4]
    for name in ("OUT3", "OUT4"):
        assert slot(state + 1, name).abs().max() < 1e-3
    # At the second word: ATT_W holds the word after the next state, W2 the one after that; the
    # third word on (after the state after) is in no slot: a drafter must find it in the book.
    second = state + 2
    assert nearest_word(second, "ATT_W") == tokens[second + 2]
    assert nearest_word(second, "W2") == tokens[second + 3]
    assert state_token(nearest_state(slot(second, "OUT4"))) == tokens[second + 4]
    # At the state: W2 holds its second word (OUTW the first).
    assert nearest_word(state, "OUTW") == tokens[state + 1]
    assert nearest_word(state, "W2") == tokens[state + 2]
