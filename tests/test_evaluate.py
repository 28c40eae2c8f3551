"""Evaluation: live speculative decoding reproduces greedy decoding token for token, an oracle
drafter is accepted K+1 tokens a round and a random one about 1, and the simulated counting."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.workflow import SMALL_RUN

from eaglenest.drafter.export import load_drafter
from eaglenest.formats.target_head import TargetHead
from eaglenest.stages.evaluate.evaluate import (
    AcceptanceCounts,
    heldout_prompts,
    live,
    per_position_acceptance,
    untrained_like,
)
from eaglenest.stages.evaluate.speculative import (
    EagleProposer,
    PromptLookupProposer,
    greedy_generate,
    prompt_lookup,
    speculative_generate,
)
from eaglenest.target_model.loading import load_target


def test_acceptance_counts_follow_the_serving_definition():
    greedy = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]])
    data = greedy.clone()
    data[3, 0] = 9  # sampled token differs from greedy after the first draft: chain is cut
    predicted = torch.tensor([[5, 6, 7], [5, 0, 7], [0, 6, 7], [5, 6, 7]])
    counts = AcceptanceCounts(3)
    counts.add(predicted, greedy, data)
    result = counts.result()
    # accepted drafts: 3, 1, 0, 1 (cut) -> 1 + 5/4
    assert result["acceptance_length"] == pytest.approx(1 + 5 / 4)
    assert result["conditional_acceptance"] == pytest.approx([3 / 4, 1 / 2, 1.0])
    assert result["cut_by_sampling"] == 1


def test_oracle_predictions_give_k_plus_one_and_random_ones_about_one():
    torch.manual_seed(0)
    greedy = torch.randint(0, 1000, (500, 7))
    oracle = AcceptanceCounts(7)
    oracle.add(greedy.clone(), greedy, greedy)
    assert oracle.result()["acceptance_length"] == 8
    random = AcceptanceCounts(7)
    random.add(torch.randint(0, 1000, (500, 7)), greedy, greedy)
    assert random.result()["acceptance_length"] < 1.05


class SuccessorTarget(torch.nn.Module):
    """A scripted target whose greedy next token is always token + 1 (mod the vocabulary)."""

    def __init__(self, vocab: int = 32):
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the decoder a device

    def forward(self, input_ids, **_):
        logits = torch.nn.functional.one_hot((input_ids + 1) % self.vocab, self.vocab).float()
        return SimpleNamespace(logits=logits, hidden_states=None)


class SuccessorProposer:
    """Drafts the successor chain from the last token: always what the target will say."""

    needs_hidden = False

    def start(self, prompt, aux, first_token):
        self.last = first_token

    def propose(self, k):
        return [self.last + 1 + i for i in range(k)]

    def accept(self, new_tokens, aux):
        self.last = new_tokens[-1]


def test_decoding_stops_at_an_end_of_turn_accepted_in_the_middle_of_a_round():
    # Output 2, 3, ..., 9 with 9 the end of turn. Round 1 (after 2) drafts 3 4 5 6, all
    # accepted, bonus 7; round 2 (after 7) drafts 8 9 10 11: the end of turn is its draft at
    # position 2 of 4. Nothing past it counts, and no third round runs.
    run = speculative_generate(SuccessorTarget(), SuccessorProposer(), [1], 4, 32, {9}, [])
    assert run.tokens == [2, 3, 4, 5, 6, 7, 8, 9]
    assert run.target_forwards == 3
    assert run.accept_lengths == [5, 3]
    assert run.draft_lengths == [4, 2]
    assert run.accepted_per_position(4) == [2, 2, 1, 1]
    assert run.drafted_per_position(4) == [2, 2, 1, 1]
    summary = per_position_acceptance([run, run], 4)
    assert summary["per_position_acceptance"] == [1.0, 1.0, 1.0, 1.0]
    assert summary["accepted_per_position"] == [4, 4, 2, 2]
    # What eval/metrics.json gets for this prompt.
    results = live(SuccessorTarget(), {"s": SuccessorProposer()}, [[1]], (4,), 32, {9}, [])
    metrics = results["s"]["4"]
    assert metrics["rounds"] == 2 and metrics["acceptance_length"] == 4.0
    assert metrics["tokens"] == metrics["greedy_tokens"] == 8 and metrics["identical_to_greedy"]
    assert metrics["per_position_acceptance"] == [1.0, 1.0, 1.0, 1.0]
    assert metrics["drafted_per_position"] == [2, 2, 1, 1]
    # The end of turn as the bonus token, and the cut at max_new_tokens, end a round the same way.
    bonus = speculative_generate(SuccessorTarget(), SuccessorProposer(), [1], 4, 32, {7}, [])
    assert (bonus.tokens, bonus.accept_lengths, bonus.draft_lengths) == (
        [2, 3, 4, 5, 6, 7],
        [5],
        [4],
    )
    cut = speculative_generate(SuccessorTarget(), SuccessorProposer(), [1], 4, 4, {9}, [])
    assert (cut.tokens, cut.accept_lengths, cut.draft_lengths) == ([2, 3, 4, 5], [4], [3])


def test_prompt_lookup_drafts_what_followed_the_last_ngram():
    assert prompt_lookup([1, 2, 3, 4, 9, 2, 3], 2, 3) == [4, 9]
    assert prompt_lookup([1, 2, 3], 2, 3) == []


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
