"""Evaluation on the small demo run (`finished_run`): live speculative decoding with its trained
drafter reproduces greedy decoding token for token, an oracle drafter is accepted K+1 tokens a
round and a random one about 1 (the counting itself:
tests/unit/stages/evaluate/test_evaluate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.workflow import SMALL_RUN

from eaglenest.drafter.eagle3.export import load_drafter
from eaglenest.formats.target_head import TargetHead
from eaglenest.stages.evaluate.live import heldout_prompts
from eaglenest.stages.evaluate.simulated import untrained_like
from eaglenest.stages.evaluate.speculative import (
    EagleProposer,
    PromptLookupProposer,
    greedy_generate,
    speculative_generate,
)
from eaglenest.target_model.loading import load_target


@pytest.fixture(scope="module")
def live_setup(finished_run: Path):
    results = finished_run / "results" / SMALL_RUN
    torch.manual_seed(0)
    target = load_target(results / "target", device="cpu", model_dtype="float32")
    head = TargetHead.load(results / "hidden" / "target_head.safetensors")
    drafter = load_drafter(results / "drafter", head.embed, head.aux_layer_ids).eval()
    prompts = heldout_prompts([results / "tokens" / "00001.parquet"], 4)
    eos = {int(json.loads((results / "target" / "config.json").read_text())["eos_token_id"])}
    return target, drafter, head, prompts, eos


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 5])
def test_live_speculative_decoding_equals_plain_greedy(live_setup, k):
    target, drafter, head, prompts, eos = live_setup
    proposers = {
        "trained": EagleProposer(drafter),
        "untrained": EagleProposer(untrained_like(drafter, 1)),
        "prompt_lookup": PromptLookupProposer(3),
    }
    for prompt in prompts:
        reference = greedy_generate(target, prompt, 48, eos)
        for name, proposer in proposers.items():
            run = speculative_generate(target, proposer, prompt, k, 48, eos, head.aux_layer_ids)
            assert run.tokens == reference.tokens, (name, k)
            assert run.target_forwards == 1 + len(run.accept_lengths)
            assert all(1 <= a <= k + 1 for a in run.accept_lengths)


class OracleProposer:
    """Drafts the target's own greedy continuation: what a perfect drafter would propose."""

    needs_hidden = False

    def __init__(self, continuation: list[int]):
        self.continuation = continuation

    def start(self, prompt, aux, first_token):
        self.done = 1

    def propose(self, k):
        return self.continuation[self.done : self.done + k]

    def accept(self, new_tokens, aux):
        self.done += len(new_tokens)


@pytest.mark.slow
def test_an_oracle_drafter_is_accepted_k_plus_one_a_round_and_a_random_one_about_one(live_setup):
    target, drafter, head, prompts, eos = live_setup
    k = 4
    for prompt in prompts:
        reference = greedy_generate(target, prompt, 64, eos)
        oracle = speculative_generate(
            target, OracleProposer(reference.tokens), prompt, k, 64, eos, head.aux_layer_ids
        )
        assert oracle.tokens == reference.tokens
        # Every round but the last (which runs into the end of the output) takes K + 1 tokens.
        assert oracle.accept_lengths[:-1] == [k + 1] * (len(oracle.accept_lengths) - 1)
    random = EagleProposer(untrained_like(drafter, 7))
    lengths = []
    for prompt in prompts:
        lengths += speculative_generate(
            target, random, prompt, k, 64, eos, head.aux_layer_ids
        ).accept_lengths
    assert sum(lengths) / len(lengths) < 1.3
