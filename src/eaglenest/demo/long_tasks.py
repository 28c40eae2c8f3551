"""Long synthetic reasoning tasks for the long-reasoning demo (`demo_target.tasks: long`).

Reasoning models answer with thousands of tokens, and a drafter's acceptance depends on the depth
it drafts at; this family gives a tiny target answers of about nine hundred to eleven thousand
tokens (median about three thousand), meant to be learnt in minutes at one thread (not yet:
docs/demo-target.md):
- rounds: the prompt gives a block of BLOCK_NUMBERS four-digit numbers and a round count; the
  answer writes the block round after round, each round labelled with the rounds left (three
  digits, counting down), and stops after round 001. A round's numbers are found one round back
  (LINE_TOKENS tokens: a drafter must attend that far at every depth), the first round's in the
  prompt; a label is the one a round back less one (borrows across its digits).

Every part of an answer lies at a fixed distance from what it depends on, because what a tiny
target learns in a few hundred steps is attention at fixed offsets: lookups by content (find
this number in the prompt, take the next) were not learnt at this budget (docs/demo-target.md).
Training draws round counts from a wider range (one round up) than the held-out prompts, so
short answers teach the countdown's end often. Round counts are log-uniform, so short and long
answers are equally represented per octave.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from eaglenest.demo.example import DemoExample

BLOCK_NUMBERS = 4  # four-digit numbers a round: " 1234" is five tokens in the demo tokenizer
LINE_TOKENS = 3 + 1 + 5 * BLOCK_NUMBERS + 1  # "017:" + the block + "\n"
# Rounds (lines of the answer): log-uniform between these.
HELDOUT_ROUNDS = (40, 440)
TRAINING_ROUNDS = (1, 440)


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))


def _rounds(rng: random.Random, rounds_range: tuple[int, int]) -> DemoExample:
    rounds = _log_uniform(rng, *rounds_range)
    numbers = [str(rng.randint(1000, 9999)) for _ in range(BLOCK_NUMBERS)]
    block = "".join(f" {n}" for n in numbers)
    # Zero-padded counts: every prompt and every line has one length in tokens, so the block
    # and the labels lie at fixed distances.
    prompt = f"Write the block {rounds:03d} times:{block}"
    lines = [f"{r:03d}:{block}" for r in range(rounds, 0, -1)]
    return DemoExample("rounds", prompt, "\n" + "\n".join(lines) + "\n", numbers[-1])


def _rounds_heldout(rng: random.Random) -> DemoExample:
    return _rounds(rng, HELDOUT_ROUNDS)


def _rounds_training(rng: random.Random) -> DemoExample:
    return _rounds(rng, TRAINING_ROUNDS)


LongFamily = Callable[[random.Random], DemoExample]
LONG_FAMILIES: dict[str, LongFamily] = {"rounds": _rounds_heldout}
LONG_TRAINING_FAMILIES: dict[str, LongFamily] = {"rounds": _rounds_training}
