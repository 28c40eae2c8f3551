"""Long synthetic reasoning tasks for the long-reasoning demo (`demo_target.tasks: long`).

Reasoning models answer with thousands of tokens, and a drafter's acceptance depends on the depth
it drafts at; these families give a tiny target answers of one to ten thousand tokens (median
about three thousand) that it learns in minutes, because each line follows from the line before by
a fixed procedure, while some tokens can only be predicted by attending far back:
- count_up / count_down: every number from A to B, one a line (carries and borrows across up to
  all five digits); when to stop and the answer are in the prompt, thousands of tokens back.
- copy: a list of distinct four-digit numbers written round after round; each number is found by
  looking up the one before it in an earlier round or the prompt (an induction lookup), and how
  many rounds to write is in the prompt.

Lengths are log-uniform, so short and long answers are equally represented per octave.
"""

from __future__ import annotations

import math
import random

from eaglenest.demo.example import DemoExample

# Steps (lines) per answer: log-uniform between these, about 6 tokens a line.
COUNT_STEPS = (150, 1800)
# Items of the copy list (5 tokens each), and the answer's length in tokens (log-uniform).
COPY_ITEMS = (6, 16)
COPY_TOKENS = (900, 11000)


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


def _count(rng: random.Random, up: bool) -> DemoExample:
    steps = _log_uniform(rng, *COUNT_STEPS)
    start = rng.randint(10000, 99999 - steps)
    numbers = list(range(start, start + steps + 1))
    if not up:
        numbers.reverse()
    first, last = numbers[0], numbers[-1]
    reasoning = "\n" + "\n".join(map(str, numbers)) + "\n"
    verb = "up" if up else "down"
    family = f"count_{verb}"
    return DemoExample(family, f"Count {verb} from {first} to {last}.", reasoning, str(last))


def _count_up(rng: random.Random) -> DemoExample:
    return _count(rng, up=True)


def _count_down(rng: random.Random) -> DemoExample:
    return _count(rng, up=False)


def _copy(rng: random.Random) -> DemoExample:
    # Distinct items, so the previous item names one place to continue the copy from.
    items = rng.sample(range(1000, 10000), rng.randint(*COPY_ITEMS))
    line_tokens = 5 * len(items) + 4  # "round 12\n" and the items
    rounds = max(2, _log_uniform(rng, *COPY_TOKENS) // line_tokens)
    listed = " ".join(map(str, items))
    lines = [f"round {r}\n{listed}" for r in range(1, rounds + 1)]
    reasoning = "\n" + "\n".join(lines) + "\n"
    prompt = f"Write the list {listed} {rounds} times."
    return DemoExample("copy", prompt, reasoning, str(rounds))


LONG_FAMILIES = {"count_up": _count_up, "count_down": _count_down, "copy": _copy}
