"""Synthetic reasoning tasks for the embedded demo target.

Each example is a short prompt, a step-by-step reasoning text and a short answer, so a tiny model
trained for a couple of minutes on CPU learns to emit `<think>\\n...\\n</think>\\n\\nanswer`. The
reasoning follows a fixed procedure per family (per-digit carries, letter-by-letter scans, ...)
because a procedure is what a small model can learn, and its tokens are what a drafter can predict.

Training and held-out examples are disjoint by prompt: a stable hash of the prompt text puts one
prompt in ten in the held-out bucket, whatever the seed. Later stages draw their demo prompts from
`heldout_examples`, so the target is always asked things it never saw in training.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable

from eaglenest.common.reasoning import THINK_END, THINK_START
from eaglenest.demo.example import DemoExample
from eaglenest.demo.long_tasks import LONG_FAMILIES

END_OF_TURN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
HELDOUT_BUCKETS = 10  # one prompt in HELDOUT_BUCKETS is held out
_MAX_DRAWS_PER_EXAMPLE = 1000  # guards against asking for more distinct prompts than exist


def _addition(rng: random.Random) -> DemoExample:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(digits_a), len(digits_b))):
        x = int(digits_a[i]) if i < len(digits_a) else 0
        y = int(digits_b[i]) if i < len(digits_b) else 0
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total}, write {total % 10} carry {total // 10}")
        carry = total // 10
    if carry:
        steps.append(f"write {carry}")
    reasoning = "\n" + "\n".join(steps) + f"\nso {a}+{b}={a + b}\n"
    return DemoExample("addition", f"What is {a} + {b}?", reasoning, str(a + b))


def _random_word(rng: random.Random) -> str:
    # Pseudo-words from a small alphabet, so the letter asked about often occurs more than once.
    letters = "aeiostrnlb"
    return "".join(rng.choice(letters) for _ in range(rng.randint(4, 8)))


def _count_letter(rng: random.Random) -> DemoExample:
    word = _random_word(rng)
    letter = rng.choice(word) if rng.random() < 0.85 else rng.choice("aeiostrnlb")
    marks = " ".join(f"{c}{'+' if c == letter else ''}" for c in word)
    count = word.count(letter)
    reasoning = f"\n{marks}\ncount of {letter}: {count}\n"
    prompt = f"How many times does the letter {letter} appear in {word}?"
    return DemoExample("count_letter", prompt, reasoning, str(count))


def _sort(rng: random.Random) -> DemoExample:
    numbers = rng.sample(range(100), rng.randint(3, 5))
    remaining, steps = list(numbers), []
    while remaining:
        smallest = min(remaining)
        remaining.remove(smallest)
        rest = ", ".join(map(str, remaining)) if remaining else "none"
        steps.append(f"smallest {smallest}, left {rest}")
    answer = ", ".join(map(str, sorted(numbers)))
    reasoning = "\n" + "\n".join(steps) + "\n"
    return DemoExample("sort", f"Sort ascending: {', '.join(map(str, numbers))}", reasoning, answer)


def _compare(rng: random.Random) -> DemoExample:
    a = rng.randint(10, 9999)
    # Often share a prefix so comparing digit by digit has more than one step.
    b = int(str(a)[: rng.randint(0, len(str(a)) - 1)] + str(rng.randint(0, 999))) or 1
    if a == b:
        b += 1
    sa, sb = str(a), str(b)
    if len(sa) != len(sb):
        steps = [f"{a} has {len(sa)} digits, {b} has {len(sb)} digits"]
    else:
        steps = [f"both have {len(sa)} digits"]
        for x, y in zip(sa, sb):
            steps.append(f"{x} vs {y}" + (" same" if x == y else ""))
            if x != y:
                break
    larger = max(a, b)
    reasoning = "\n" + "\n".join(steps) + f"\nlarger is {larger}\n"
    return DemoExample("compare", f"Which is larger, {a} or {b}?", reasoning, str(larger))


def _parity(rng: random.Random) -> DemoExample:
    n = rng.randint(0, 99999)
    last = n % 10
    word = "even" if last % 2 == 0 else "odd"
    reasoning = f"\nlast digit of {n} is {last}\n{last} is {word}\n"
    return DemoExample("parity", f"Is {n} even or odd?", reasoning, word)


Family = Callable[[random.Random], DemoExample]
_FAMILIES: dict[str, Family] = {
    "addition": _addition,
    "count_letter": _count_letter,
    "sort": _sort,
    "compare": _compare,
    "parity": _parity,
}
TASK_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)
# The short tasks of the embedded demo, and the long ones of the long-reasoning demo
# (long_tasks.py): `demo_target.tasks`, and the prompt sources `demo` and `demo-long`.
TASK_SUITES = ("short", "long", "cite")


def suite_families(suite: str) -> dict[str, Family]:
    """The task families of `suite` (one of TASK_SUITES), in their round-robin order."""
    if suite == "short":
        return _FAMILIES
    if suite == "long":
        return LONG_FAMILIES
    if suite == "cite":  # its examples need the target's shape: cite_tasks.cite_examples
        raise ValueError("the cite suite's examples are drawn by eaglenest.demo.cite_tasks")
    raise ValueError(f"unknown demo task suite {suite!r}; known: {', '.join(TASK_SUITES)}")


def make_example(rng: random.Random, family: str, suite: str = "short") -> DemoExample:
    """Draw one example of `family` (one of `suite`'s families) from `rng`."""
    families = suite_families(suite)
    if family not in families:
        raise ValueError(f"unknown demo task family {family!r}; known: {', '.join(families)}")
    return families[family](rng)


def is_heldout_prompt(prompt: str) -> bool:
    """Stable across processes and seeds (unlike `hash`): the split depends on the text alone."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_BUCKETS == 0


def _draw(seed: int, n: int, heldout: bool, distinct: bool, suite: str) -> list[DemoExample]:
    # A string seed keeps the train and held-out streams independent for the same integer seed.
    stream = f"{'heldout' if heldout else 'train'}-{seed}"
    rng = random.Random(
        f"eaglenest-demo-{stream}" if suite == "short" else f"eaglenest-{suite}-{stream}"
    )
    families = tuple(suite_families(suite))
    examples: list[DemoExample] = []
    seen: set[str] = set()
    for i in range(n):
        family = families[i % len(families)]
        for _ in range(_MAX_DRAWS_PER_EXAMPLE):
            example = make_example(rng, family, suite)
            if is_heldout_prompt(example.prompt) != heldout:
                continue
            if distinct and example.prompt in seen:
                continue
            seen.add(example.prompt)
            examples.append(example)
            break
        else:
            raise ValueError(f"could not draw {n} distinct prompts of family {family!r}")
    return examples


def training_examples(seed: int, n: int, suite: str = "short") -> list[DemoExample]:
    """`n` training examples, families round-robin; never a held-out prompt (repeats allowed)."""
    return _draw(seed, n, heldout=False, distinct=False, suite=suite)


def heldout_examples(seed: int, n: int, suite: str = "short") -> list[DemoExample]:
    """`n` distinct held-out examples, families round-robin; none of them is ever trained on."""
    return _draw(seed, n, heldout=True, distinct=True, suite=suite)


def check_answer(example: DemoExample, content: str | None) -> bool:
    """True when the final answer (the text after the think block) is the expected one."""
    return content is not None and " ".join(content.split()) == example.answer


_WELL_FORMED = re.compile(
    re.escape(THINK_START) + r"\n(?P<reasoning>.*?)\n" + re.escape(THINK_END) + r"\n\n"
    r"(?P<content>.+?)" + re.escape(END_OF_TURN) + f"(?:{re.escape(PAD_TOKEN)})*",
    re.DOTALL,
)


def is_well_formed(completion_text: str) -> bool:
    """True for `<think>\\n...\\n</think>\\n\\nanswer<|im_end|>` with one think block, non-empty
    reasoning and answer; `completion_text` is decoded with special tokens kept (trailing padding
    allowed)."""
    match = _WELL_FORMED.fullmatch(completion_text)
    if match is None:
        return False
    if completion_text.count(THINK_START) != 1 or completion_text.count(THINK_END) != 1:
        return False
    content = match["content"]
    return bool(match["reasoning"].strip()) and bool(content.strip()) and "<|" not in content
