"""The long-reasoning demo's task (`demo_target.tasks: long`, prompt source `demo-long`): walks
along a chain, thousands of steps long, whose rule is set by a key given once, in the prompt.

Reasoning models answer with thousands of tokens, and a drafter's acceptance depends on the depth
it drafts at; this task gives answers of LENGTHS tokens (log-uniform, median about 2,500,
one in eight past 8,192), where every token depends on the one before it and on a token thousands back:
- chain: the prompt names a key (one of KEYS, each with its step STEPS[key]) and a start state;
  the reasoning writes the states start+step, start+2·step, ... (mod STATES), one token each,
  until the next would be END_STATE; the answer is the key. The key lies in the prompt only, so
  every step, at any depth, needs it: a drafter whose attention loses the prompt loses the walk.

A target cannot be trained to do this in the minutes a demo has (docs/demo-target.md: the tries
with trained targets), so the long target is written, not trained: demo/long_target.py sets its
weights so that greedy decoding walks the chain exactly (its held-out check proves it).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from eaglenest.demo.example import DemoExample

STATES = 10_240  # states of the chain: n -> n + step (mod STATES); the longest walk has STATES - 1
END_STATE = 0  # has no token of its own: the walk ends where its next state would be this
KEYS = 8
# A step a key, prime to STATES (2^11 * 5), so each key's walk visits every state once before it
# comes back (a single cycle).
STEPS = (1_237, 2_999, 4_421, 5_003, 7_919, 8_837, 9_391, 10_007)
# The reasoning's states: log-uniform between these (median about 2,300), and one answer in
# LONGEST_SHARE^-1 past LONGEST (the depths where published drafters lose their acceptance).
LENGTHS = (600, 9_000)
LONGEST, LONGEST_SHARE = 8_192, 1 / 8


def state_token(n: int) -> str:
    """A state's token: fixed width, no separator, so the walk's text splits only one way."""
    return f"s{n:05d}"


def key_token(key: int) -> str:
    return f"K{key:02d}"


def start_for(key: int, length: int) -> int:
    """The start whose walk under `key` writes `length` states before END_STATE."""
    return (END_STATE - (length + 1) * STEPS[key]) % STATES


def walk(key: int, start: int) -> list[int]:
    """The states written from `start` under `key`, END_STATE excluded."""
    states, n = [], (start + STEPS[key]) % STATES
    while n != END_STATE:
        states.append(n)
        n = (n + STEPS[key]) % STATES
    return states


def chain_example(key: int, length: int) -> DemoExample:
    start = start_for(key, length)
    reasoning = "".join(state_token(n) for n in walk(key, start))
    prompt = f"Walk the chain {key_token(key)} from {state_token(start)}."
    return DemoExample("chain", prompt, "\n" + reasoning + "\n", key_token(key))


def _chain(rng: random.Random) -> DemoExample:
    low, high = LENGTHS
    if rng.random() < LONGEST_SHARE:
        length = rng.randint(LONGEST, high)
    else:
        length = int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))
    return chain_example(rng.randrange(KEYS), length)


def check_examples(n: int) -> list[DemoExample]:
    """The written target's build check: `n` walks of 600 to 1,500 states, keys in turn."""
    return [chain_example(i % KEYS, 600 + 900 * i // max(1, n - 1)) for i in range(n)]


LongFamily = Callable[[random.Random], DemoExample]
LONG_FAMILIES: dict[str, LongFamily] = {"chain": _chain}
