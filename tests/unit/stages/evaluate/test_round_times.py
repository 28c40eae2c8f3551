"""The live loop's times a round (eval/metrics.json's live figures, which the report's choice of
drafter family reads): the drafter's own time, the target's verification (the round less the
drafter's; the target's prefill and the drafter's start over the prompt left out) and the
target's plain greedy step, each measured apart."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from eaglenest.stages.evaluate.live import live

TARGET_S = 0.002  # a target forward, whatever its width
DRAFTER_S = 0.030  # a draft
START_S = 0.150  # the proposer's start, once a run


class SlowSuccessorTarget(torch.nn.Module):
    """A scripted target whose greedy next token is token + 1, TARGET_S a forward."""

    def __init__(self, vocab: int = 64):
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the decoder a device

    def forward(self, input_ids, **_):
        time.sleep(TARGET_S)
        logits = torch.nn.functional.one_hot((input_ids + 1) % self.vocab, self.vocab).float()
        return SimpleNamespace(logits=logits, hidden_states=None)


class SlowSuccessorProposer:
    """Drafts what the target will say, DRAFTER_S a draft."""

    needs_hidden = False

    def start(self, prompt, aux, first_token):
        time.sleep(START_S)  # the drafter over the prompt: no round's
        self.last = first_token

    def propose(self, k):
        time.sleep(DRAFTER_S)
        return [self.last + 1 + i for i in range(k)]

    def accept(self, new_tokens, aux):
        self.last = new_tokens[-1]


def test_the_drafters_and_the_targets_time_a_round_are_measured_apart():
    proposers = {"slow": SlowSuccessorProposer()}
    results = live(SlowSuccessorTarget(), proposers, [[1], [5]], (3,), 13, set(), [])
    figures = results["slow"]["3"]
    # 12 tokens after the prefill's, 4 a round: 3 rounds a prompt, every draft accepted.
    assert figures["rounds"] == 6 and figures["emitted_per_round"] == 4.0
    assert figures["drafter_s_per_round"] >= DRAFTER_S
    # The target's verification a round: one forward, neither the drafter's drafts nor its
    # start over the prompt (0.15 s over 3 rounds: 50 ms a round).
    assert TARGET_S <= figures["target_s_per_round"] < figures["drafter_s_per_round"] / 2
    # Its plain greedy step: one forward a token, on the same prompts.
    assert TARGET_S <= figures["greedy_s_per_token"] < figures["drafter_s_per_round"] / 2
