"""The collapsing demo's task (`demo_target.tasks: cite`, prompt source `demo-cite`): the long
demo's walk, then a second phase that recites a book given once, in the prompt.

The long demo cannot collapse (its target's features hold the next four states, so a drafter
reads every draft off them at any depth). This task is built so that a drafter trained the peers'
way does collapse, for two reasons a drafter can be trained against (docs/demo-target.md):
- a change of regime past a depth D: the walk of phase 1 (D states, as long_tasks') ends with
  `<recite>`, and phase 2 interleaves the walk's next cycle with the book's words, two words
  after each state: `n w w n' w w ...`, until the walk comes round again (`<recite>` once more).
  Words appear in no answer before D: a drafter trained on answers cut before D never drafted one;
- citing from far: the words come from the prompt's book, in order, round and round
  (`<book> w.. w.. <book>`: the marker is the book's last word too, so the order is a cycle). The
  target's features hold the next two words, not the third, so a drafter must find the third in
  the book itself: at depth d the book lies d tokens back (and its last recital about 1.5 books
  back), a distance a drafter trained on short sequences never attended.

The walk's states and keys are long_tasks', over `states` states (the target's size: a full
cycle of phase 2 is 3 (states - 1) tokens); a book is `book` distinct words of `words`.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import asdict, dataclass

from eaglenest.common.reasoning import THINK_END, THINK_START
from eaglenest.demo.example import DemoExample
from eaglenest.demo.long_tasks import END_STATE, KEYS, STEPS, key_token, state_token
from eaglenest.demo.tasks import END_OF_TURN

# Saved beside a cite target's weights: what the rule needs to answer as the target (RuleBackend).
CITE_RULE_FILE = "cite_rule.json"
BOOK = "<book>"  # opens and closes the prompt's book; recited as its last word
RECITE = "<recite>"  # ends each phase of the walk: stands for the walk's end state


def word_token(w: int) -> str:
    """Word w's token (w >= 1: word 0 is BOOK, whose identity `<recite>` shares)."""
    return f"w{w:04d}"


@dataclass(frozen=True)
class CiteShape:
    """The sizes of a cite target and of its prompts: `states` of the walk (a multiple of 5 and a
    power of 2, so every key's step is prime to it), `words` in the vocabulary (word 0: BOOK), and
    the ranges the prompts draw their walk's first phase and their book from."""

    states: int
    words: int
    walk: tuple[int, int]  # phase 1's states: log-uniform in [lo, hi]
    book: tuple[int, int]  # the book's words: uniform in [lo, hi]

    def __post_init__(self) -> None:
        n = self.states
        while n % 2 == 0:
            n //= 2
        if n not in (1, 5) or self.states < 40:
            raise ValueError(f"demo_target.cite.states {self.states}: a power of 2 times 5")
        lo, hi = self.walk
        # A walk of states - 1 would start at the end state, which has no token.
        if not 1 <= lo <= hi <= self.states - 2:
            raise ValueError(f"demo_target.cite.walk {self.walk}: within 1 .. states - 2")
        lo, hi = self.book
        if not 2 <= lo <= hi <= self.words - 1:
            raise ValueError(f"demo_target.cite.book {self.book}: within 2 .. words - 1")

    def step(self, key: int) -> int:
        return STEPS[key] % self.states

    def answer_tokens(self, walk: int) -> int:
        """Generated tokens of an answer whose first phase walks `walk` states: `<think>\\n`,
        the walk, `<recite>`, the next cycle (a state and two words each), `<recite>\\n`,
        `</think>\\n\\n`, the key and the end of the turn."""
        return 2 + walk + 1 + 3 * (self.states - 1) + 2 + 2 + 2


def cite_start(shape: CiteShape, key: int, walk: int) -> int:
    """The start whose walk writes `walk` states before the end state."""
    return (END_STATE - (walk + 1) * shape.step(key)) % shape.states


def cycle(shape: CiteShape, key: int, first: int) -> list[int]:
    """The states from `first` on under `key`, until the next would be the end state."""
    states, n = [], first
    while n != END_STATE:
        states.append(n)
        n = (n + shape.step(key)) % shape.states
    return states


def cite_reasoning(shape: CiteShape, key: int, start: int, book: list[int]) -> list[str]:
    """The reasoning's tokens (between `<think>\\n` and `\\n</think>`): the rule the target's
    greedy decoding follows exactly, and the oracle drafter's."""
    tokens = [state_token(n) for n in cycle(shape, key, (start + shape.step(key)) % shape.states)]
    tokens.append(RECITE)
    recited = [word_token(w) for w in book] + [BOOK]
    at = 0
    for n in cycle(shape, key, shape.step(key)):
        tokens.append(state_token(n))
        for _ in range(2):
            tokens.append(recited[at % len(recited)])
            at += 1
    tokens.append(RECITE)
    return tokens


def cite_prompt(key: int, start: int, book: list[int]) -> str:
    words = "".join(word_token(w) for w in book)
    return (
        f"Walk the chain {key_token(key)} from {state_token(start)}, "
        f"then recite {BOOK}{words}{BOOK}."
    )


# cite_prompt's parts in order, each with what it holds (named when a prompt lacks it).
_PROMPT_PARTS = (
    ("the chain's key (K<nn>)", re.compile(r"Walk the chain K(\d{2}) ")),
    ("the start state (s<nnnnn>)", re.compile(r"from s(\d{5}), ")),
    (
        "the book (<book>w<nnnn>...<book>.)",
        re.compile(r"then recite <book>((?:w\d{4})*)<book>\.\Z"),
    ),
)


def parse_cite_prompt(shape: CiteShape, text: str) -> tuple[int, int, list[int]]:
    """(key, start, book) of a prompt `cite_prompt` wrote for a target of `shape`; ValueError
    naming the first part it could not parse, or a value the target has no token or rule for."""
    values, at = [], 0
    for what, pattern in _PROMPT_PARTS:
        match = pattern.match(text, at)
        if match is None:
            raise ValueError(f"could not parse {what} at character {at}: {text[at : at + 40]!r}")
        values.append(match.group(1))
        at = match.end()
    key, start = int(values[0]), int(values[1])
    book = [int(w) for w in re.findall(r"w(\d{4})", values[2])]
    if key >= KEYS:
        raise ValueError(f"the key {key_token(key)} is none of the {KEYS} keys")
    if not END_STATE < start < shape.states:  # the end state has no token of its own
        raise ValueError(f"the start state {start} is not within 1 .. {shape.states - 1}")
    if len(book) < 2 or len(set(book)) < len(book):
        raise ValueError(f"the book must hold 2 or more distinct words, not {len(book)}")
    if not all(1 <= w < shape.words for w in book):
        raise ValueError(f"the book's words must lie within 1 .. {shape.words - 1}")
    return key, start, book


def answer_text(example: DemoExample) -> str:
    """The completion's text as the target writes it: the think block, the answer, the turn's end
    (what its build proves teacher-forced, and what the rule backend serves)."""
    return f"{THINK_START}{example.reasoning}{THINK_END}\n\n{example.answer}{END_OF_TURN}"


def cite_example_at(shape: CiteShape, key: int, start: int, book: list[int]) -> DemoExample:
    reasoning = "".join(cite_reasoning(shape, key, start, book))
    return DemoExample(
        "cite", cite_prompt(key, start, book), "\n" + reasoning + "\n", key_token(key)
    )


def cite_example(shape: CiteShape, key: int, walk: int, book: list[int]) -> DemoExample:
    return cite_example_at(shape, key, cite_start(shape, key, walk), book)


def draw_cite(shape: CiteShape, rng: random.Random) -> DemoExample:
    """One example: a key, a first phase log-uniform in shape.walk, a book of distinct words."""
    lo, hi = shape.walk
    walk = int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))
    walk = min(max(walk, lo), hi)
    size = rng.randint(*shape.book)
    book = rng.sample(range(1, shape.words), size)
    return cite_example(shape, rng.randrange(KEYS), walk, book)


def cite_check_examples(shape: CiteShape, n: int) -> list[DemoExample]:
    """The build's check: `n` examples, keys in turn, the shortest walks and books of the shape's
    ranges (a greedy decoding of a whole answer: 3 (states - 1) tokens and more)."""
    rng = random.Random(f"eaglenest-cite-check-{shape}")
    return [
        cite_example(
            shape, i % KEYS, shape.walk[0], rng.sample(range(1, shape.words), shape.book[0])
        )
        for i in range(n)
    ]


def rule_of(shape: CiteShape, seed: int, min_right_probability: float) -> dict:
    """CITE_RULE_FILE's content: the shape the target was written for, its seed, and the right
    token's smallest probability at temperature 1 over the build's check answers."""
    return {
        "tasks": "cite",
        "shape": asdict(shape),
        "seed": seed,
        "min_right_probability": min_right_probability,
    }


def shape_of(cite: dict) -> CiteShape:
    """The shape `demo_target.cite` names (its schema's defaults filled in)."""
    return CiteShape(
        states=cite["states"],
        words=cite["words"],
        walk=tuple(cite["walk"]),
        book=tuple(cite["book"]),
    )


def cite_examples(shape: CiteShape, target_seed: int, seed: int, n: int) -> list[DemoExample]:
    """The `demo-cite` source's pool: `n` examples drawn from the target's seed and the run's
    (another demo_target.seed: other books, keys and walks, as other frequencies)."""
    rng = random.Random(f"eaglenest-cite-{target_seed}-{seed}")
    return [draw_cite(shape, rng) for _ in range(n)]
