"""Evaluation: the acceptance counting (simulated and live, on the serving definition), the end
of a round, prompt lookup; on the demo run's trained drafter:
tests/workflow/test_live_evaluation.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.drafter_sizes import CONFIG

from eaglenest.drafter.eagle3.model import Eagle3Drafter, ttt_forward
from eaglenest.stages.evaluate.live import live, per_position_acceptance
from eaglenest.stages.evaluate.simulated import (
    AcceptanceCounts,
    chain_predictions,
    lookup_predictions,
)
from eaglenest.stages.evaluate.speculative import (
    prompt_lookup,
    speculative_generate,
)


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


def test_simulated_chains_score_the_head_only_where_they_live_and_count_as_whole_ones():
    """The simulated acceptance's drafts, the LM head run only at positions whose chain reaches
    a step, count exactly as every position's whole chain does: scored from a drafter whose
    greedy target agrees with it often, so chains end at every step."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(CONFIG).eval()
    b, t, k = 2, 40, 4
    input_ids = torch.randint(0, CONFIG.vocab_size, (b, t))
    aux = torch.randn(b, t, len(CONFIG.aux_layer_ids) * CONFIG.target_hidden_size)
    with torch.no_grad():
        logits = ttt_forward(drafter, aux, input_ids, k)
    full = torch.stack([drafter.draft_to_target(step.argmax(-1)) for step in logits], dim=-1)
    greedy = full.clone()  # the target agrees with the drafter, but for one position in four
    disagree = torch.rand(b, t, k) < 0.25
    greedy[disagree] = -1
    data_next = greedy.clone()
    data_next[torch.rand(b, t, k) < 0.1] = 7  # the sample went another way (cut by sampling)
    start = torch.ones(b, t, dtype=torch.bool)
    start[:, -k - 2 :] = False
    batch = SimpleNamespace(aux=aux, input_ids=input_ids)
    with torch.no_grad():
        lean = chain_predictions(drafter, batch, start, greedy, data_next, k)
    scored = lean != -3
    assert scored[..., 0].equal(start)
    assert 0 < scored[..., 2:].sum() < start.sum()  # some chains live on, others have ended
    assert lean[scored].equal(full[scored])
    whole, partial = AcceptanceCounts(k), AcceptanceCounts(k)
    whole.add(full[start], greedy[start], data_next[start])
    partial.add(lean[start], greedy[start], data_next[start])
    assert partial.result() == whole.result()
    assert whole.result()["acceptance_length"] > 1.5


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
    # Per prompt (the report's interval by depth): its rounds' mean, and its rounds.
    assert metrics["per_prompt"] == [4.0] and metrics["rounds_per_prompt"] == [2]
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


def test_simulated_prompt_lookup_drafts_what_a_search_of_the_context_drafts():
    """lookup_predictions' growing n-gram index gives, at every drafting position, what
    prompt_lookup's search of the context so far gives (repeats of every length included)."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 6, (3, 300), generator=generator)
    lengths = torch.tensor([300, 211, 2])
    loss_mask = torch.rand((3, 300), generator=generator) > 0.2
    predicted = lookup_predictions(input_ids, lengths, loss_mask, k=4, ngram=3)
    for row in range(3):
        ids = input_ids[row, : int(lengths[row])].tolist()
        for pos in range(300):
            expected = [-2] * 4
            if pos < len(ids) - 1 and loss_mask[row, pos + 1]:
                drafts = prompt_lookup(ids[: pos + 2], 4, 3)
                expected[: len(drafts)] = drafts
            assert predicted[row, pos].tolist() == expected, (row, pos)
