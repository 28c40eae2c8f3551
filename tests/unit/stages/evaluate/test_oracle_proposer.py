"""The oracle of a written target (`ContinuationProposer`): the held-out sample's own next tokens,
which the target's greedy decoding writes, so every round accepts K + 1 at any depth; a prompt
with no sample behind it is refused."""

from __future__ import annotations

import random

import pytest

from eaglenest.demo.cite_build import answer_ids
from eaglenest.demo.cite_target import write_cite_target
from eaglenest.demo.cite_tasks import CiteShape, draw_cite
from eaglenest.stages.evaluate.speculative import (
    ContinuationProposer,
    greedy_generate,
    speculative_generate,
)

SHAPE = CiteShape(states=160, words=64, walk=(64, 150), book=(16, 32))


def test_the_oracle_accepts_k_plus_one_a_round_in_the_walk_and_in_the_recital():
    model, tokenizer, _ = write_cite_target(SHAPE, 300, 2048, seed=0)
    ids, prompt_len = answer_ids(tokenizer, draw_cite(SHAPE, random.Random(3)))
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    oracle = ContinuationProposer([ids])
    for cut in (prompt_len, prompt_len + 200):  # the walk, then the recital (walk <= 150)
        prompt = ids[:cut]
        run = speculative_generate(model, oracle, prompt, 3, 40, eos, [])
        assert run.tokens == greedy_generate(model, prompt, 40, eos).tokens == ids[cut : cut + 40]
        assert run.accept_lengths[:-1] == [4] * (len(run.accept_lengths) - 1)
    with pytest.raises(ValueError, match="no held-out sample"):
        ContinuationProposer([ids]).start([1, 2, 3], None, 0)
