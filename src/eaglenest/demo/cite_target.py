"""The collapsing demo's target, written rather than trained (as demo/long_target.py, whose
conventions it keeps): a Qwen3 causal LM whose greedy decoding follows cite_tasks' rule exactly,
at every depth, and whose features hold what a drafter needs for the walk but only the next two
words of the recital, so that a drafter must find the third in the prompt's book itself.

How it computes (the residual stream has named slots, `slots()`; a constant slot holds the RMS
near 1, so every norm leaves the slots as they are but for a factor per position):
- the embedding: a state's Fourier features (IN), a word's (WID, over `words` identities; BOOK
  and `<recite>` share word 0), `<recite>` also holds the end state in IN (it stands for it), a
  key's one-hot, and a flag for each kind of token;
- layer 0: head 0 copies the previous token (PREV_IN, PREV_WID and its flags), head 2 the token
  two back (PREV2_IN), both from RoPE's fastest planes phase-shifted by one or two positions;
  head 1 copies the key from the prompt, from any distance (RoPE's slowest plane);
- layer 1: head 0 copies the prompt's start state after `<think>` (long_target's); the MLP moves
  it into IN there, and writes the recital's query and key: QW (the word whose successor comes
  next: the current word at a word, the previous one at a state of phase 2) and KEYW (the
  previous word, at words only: the book's order, and the recital's own word pairs, which agree);
- layer 2: head 0 recites: QW against KEYW on RoPE's slow planes (rope_theta 1e9: they turn less
  than 0.02 rad over 45K positions), copying the word after it (ATT_W); the MLP gates it into
  OUTW where a word comes next, turns IN (or, at a second word, PREV2_IN) by the key's step into
  OUT where a state comes next, and raises the flags of the special tokens;
- layer 3's MLP writes the states further on into OUT2 ... OUT4 (which tokens ahead are states
  depends on the phase: `_lookahead`), and its head 0 recites once more: ATT_W against KEYW,
  copying the word after the next into W2 (the first W2_FREQ of a word's frequencies): features
  the target does not read, as in long_target, so that a drafter reads the walk off them at any
  depth, and the next two words; the third word on is in no feature (a drafter drafting it
  must find it in the book itself);
- the LM head scores states and `<recite>` (the end state) by OUT, words by OUTW, specials by
  their flags. Layer 4 is the identity: the aux layers (2, 3, 4) are layers 1-3's outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from eaglenest.common.reasoning import THINK_END, THINK_START
from eaglenest.demo.cite_tasks import BOOK, RECITE, CiteShape, cite_prompt, word_token
from eaglenest.demo.long_tasks import END_STATE, KEYS, key_token, state_token
from eaglenest.demo.tasks import END_OF_TURN
from eaglenest.demo.written import (
    AHEAD,
    CONTENT_SCORE,
    FLAG_LOGIT,
    GATE,
    HEAD_DIM,
    KEY_PLANE,
    KV_HEADS,
    NUM_LAYERS,
    PREV_PLANES,
    PREV_SCALE,
    STATE_LOGIT,
    fourier,
    rotation,
    written_model,
)

CITE_HIDDEN = 640
CITE_HEADS = (
    5  # 640 / 5 = HEAD_DIM: the drafter takes the count, and vLLM wants hidden = heads x head_dim
)
CITE_N_FREQ = 24  # a state's frequencies (the best wrong state scores under 0.44 of the right one)
N_WORD_FREQ = 16  # a word's (under 0.47): 16 of RoPE's slow planes hold the recital's match
W2_FREQ = 11  # the word after the next (W2): a word's first 11 frequencies, the room left
CITE_ROPE_THETA = 1e9  # planes 40 .. 63 turn under 0.1 rad over 45K positions
RECITE_PLANES = list(range(KEY_PLANE - N_WORD_FREQ, KEY_PLANE))  # 47 .. 62
CITE_BIG = math.sqrt(CITE_HIDDEN)
RECITE_SCORE = 48.0  # the match's score; the best wrong word's under 0.47 of it
WORD_LOGIT = 2.0
FREQUENCY_DRAWS = 50  # draws of a frequency set, the one with the widest margin kept

STATE_SLOTS = ["IN", *AHEAD, "START", "PREV_IN", "PREV2_IN"]
WORD_SLOTS = ["WID", "PREV_WID", "KEYW", "QW", "ATT_W", "OUTW"]
FLAGS = [
    "IS_NL",
    "IS_THINK",
    "IS_STATE",
    "IS_THINK_END",
    "IS_NN",
    "IS_KEY",
    "IS_WORD",
    "IS_RECITE",
    "PREV_THINK",
    "PREV_STATE",
    "PREV_WORD",
    "WANT_THINK",
    "WANT_NL",
    "WANT_THINK_END",
    "WANT_NN",
    "WANT_EOS",
]


def slots() -> dict[str, slice | int]:
    names = [(n, 2 * CITE_N_FREQ) for n in STATE_SLOTS] + [(n, 2 * N_WORD_FREQ) for n in WORD_SLOTS]
    names += [("KEY", KEYS), ("KEY_EMB", KEYS), ("WANT_KEY", KEYS)] + [(f, 1) for f in FLAGS]
    names += [("W2", 2 * W2_FREQ)]
    out: dict[str, slice | int] = {}
    at = 0
    for name, size in names:
        out[name] = at if size == 1 else slice(at, at + size)
        at += size
    assert at <= CITE_HIDDEN - 1, at
    out["BIG"] = CITE_HIDDEN - 1
    return out


CITE_SLOTS = slots()


def rows(name: str) -> list[int]:
    return list(range(CITE_SLOTS[name].start, CITE_SLOTS[name].stop))


def best_frequencies(space: int, n: int, seed: int) -> np.ndarray:
    """`n` frequencies of a space of `space` identities, the draw (of FREQUENCY_DRAWS for this
    seed) under which the best wrong identity scores the least against the right one."""
    best, best_margin = None, 2.0
    for draw in range(FREQUENCY_DRAWS):
        rng = np.random.default_rng([seed, space, n, draw])
        freqs = np.sort(rng.choice(np.arange(1, space // 2), size=n, replace=False))
        worst = np.cos(2 * np.pi * np.outer(np.arange(1, space), freqs) / space).sum(1).max() / n
        if worst < best_margin:
            best, best_margin = freqs, worst
    return best


@dataclass(frozen=True)
class CiteTarget:
    """What the weights are written for: the shape, the frequencies and the token ids."""

    shape: CiteShape
    freqs: np.ndarray
    word_freqs: np.ndarray
    vocab: int
    states: np.ndarray
    state_ids: np.ndarray
    word_ids: np.ndarray  # of words 1 .. words - 1
    book: int
    recite: int
    keys: list[int]
    nl: int
    nn: int
    think: int
    think_end: int
    eos: int

    def state_features(self, states: np.ndarray) -> np.ndarray:
        return fourier(states, self.freqs, self.shape.states)

    def word_features(self, words: np.ndarray) -> np.ndarray:
        return fourier(words, self.word_freqs, self.shape.words)

    def turn(self, steps: int, key: int) -> np.ndarray:
        return rotation(steps * self.shape.step(key), self.freqs, self.shape.states)


def cite_tokenizer(shape: CiteShape, vocab_size: int) -> Any:
    """The demo tokenizer trained on the prompts' words, with every state, key and word and the
    two markers as one added token each."""
    from tokenizers import AddedToken

    from eaglenest.demo.target_tokenizer import build_demo_tokenizer

    # "\n\n" often enough to be one token (the answer's separator, as the target writes it).
    words = [cite_prompt(k, 1, [1, 2]) for k in range(KEYS)] + ["\n\n" + key_token(0)] * 8
    tokenizer = build_demo_tokenizer(["user\nassistant\nsystem\n"] * 8 + words * 8, vocab_size)
    names = [state_token(n) for n in range(shape.states) if n != END_STATE]
    names += [key_token(k) for k in range(KEYS)] + [BOOK, RECITE]
    names += [word_token(w) for w in range(1, shape.words)]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in names])
    return tokenizer


def describe(shape: CiteShape, tokenizer: Any, seed: int) -> CiteTarget:
    tid = tokenizer.convert_tokens_to_ids
    nl, nn = tokenizer.encode("\n"), tokenizer.encode("\n\n")
    assert len(nl) == 1 and len(nn) == 1, (nl, nn)
    states = np.array([n for n in range(shape.states) if n != END_STATE])
    return CiteTarget(
        shape=shape,
        freqs=best_frequencies(shape.states, CITE_N_FREQ, seed),
        word_freqs=best_frequencies(shape.words, N_WORD_FREQ, seed),
        vocab=len(tokenizer),
        states=states,
        state_ids=np.array([tid(state_token(n)) for n in states]),
        word_ids=np.array([tid(word_token(w)) for w in range(1, shape.words)]),
        book=tid(BOOK),
        recite=tid(RECITE),
        keys=[tid(key_token(k)) for k in range(KEYS)],
        nl=nl[0],
        nn=nn[0],
        think=tid(THINK_START),
        think_end=tid(THINK_END),
        eos=tid(END_OF_TURN),
    )


def _embedding(t: CiteTarget) -> np.ndarray:
    s = CITE_SLOTS
    embed = np.zeros((t.vocab, CITE_HIDDEN))
    embed[:, s["BIG"]] = CITE_BIG
    embed[np.ix_(t.state_ids, rows("IN"))] = t.state_features(t.states)
    embed[t.state_ids, s["IS_STATE"]] = 1
    embed[np.ix_(t.word_ids, rows("WID"))] = t.word_features(np.arange(1, t.shape.words))
    embed[t.word_ids, s["IS_WORD"]] = 1
    word0 = t.word_features(np.array([0]))[0]
    for marker in (t.book, t.recite):
        embed[marker, rows("WID")] = word0
        embed[marker, s["IS_WORD"]] = 1
    embed[t.recite, rows("IN")] = t.state_features(np.array([END_STATE]))[0]
    embed[t.recite, s["IS_RECITE"]] = 1
    for key, i in enumerate(t.keys):
        embed[i, s["KEY_EMB"].start + key] = 1
        embed[i, s["IS_KEY"]] = 1
    for token, flag in (
        (t.nl, "IS_NL"),
        (t.nn, "IS_NN"),
        (t.think, "IS_THINK"),
        (t.think_end, "IS_THINK_END"),
    ):
        embed[token, s[flag]] = 1
    return embed


def _projections(w: dict[str, np.ndarray], layer: int) -> tuple[np.ndarray, ...]:
    shapes = {
        "q_proj": (CITE_HEADS * HEAD_DIM, CITE_HIDDEN),
        "k_proj": (KV_HEADS * HEAD_DIM, CITE_HIDDEN),
        "v_proj": (KV_HEADS * HEAD_DIM, CITE_HIDDEN),
        "o_proj": (CITE_HIDDEN, CITE_HEADS * HEAD_DIM),
    }
    for name, shape in shapes.items():
        w[f"model.layers.{layer}.self_attn.{name}.weight"] = np.zeros(shape)
    return tuple(w[f"model.layers.{layer}.self_attn.{name}.weight"] for name in shapes)


def _attention_layers() -> dict[str, np.ndarray]:
    """Layers 0-3's q, k, v, o. Value row r of the one key/value head holds a slot's entry;
    each head writes the rows it copies into its own slots."""
    s = CITE_SLOTS
    w: dict[str, np.ndarray] = {}
    half = HEAD_DIM // 2
    theta = CITE_ROPE_THETA ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)

    def value(v, at: int, sources: list[int]) -> list[int]:
        for i, a in enumerate(sources):
            v[at + i, a] = 1
        return list(range(at, at + len(sources)))

    def write(o, head: int, value_rows: list[int], dest: list[int]) -> None:
        for r, b in zip(value_rows, dest, strict=True):
            o[b, head * HEAD_DIM + r] = 1

    # Layer 0: the previous token (head 0), the key (head 1), the token two back (head 2).
    q, k, v, o = _projections(w, 0)
    for j in range(PREV_PLANES):
        # Scores cos(theta_j (distance - 1)) and cos(theta_j (distance - 2)) (a plane's pair
        # as a complex number: q conj(k) e^(i theta distance)).
        k[j, s["BIG"]] = math.cos(theta[j]) / CITE_BIG
        k[j + half, s["BIG"]] = math.sin(theta[j]) / CITE_BIG
        q[j, s["BIG"]] = 1 / CITE_BIG
        q[2 * HEAD_DIM + j, s["BIG"]] = math.cos(theta[j]) / CITE_BIG
        q[2 * HEAD_DIM + j + half, s["BIG"]] = -math.sin(theta[j]) / CITE_BIG
    q[HEAD_DIM + KEY_PLANE, s["BIG"]] = 1 / CITE_BIG
    k[KEY_PLANE, s["IS_KEY"]] = 1
    flags = value(v, 0, [s["IS_THINK"], s["IS_STATE"], s["IS_WORD"]])
    keys = value(v, 3, rows("KEY_EMB"))
    ins = value(v, 3 + KEYS, rows("IN"))
    wids = value(v, 3 + KEYS + 2 * CITE_N_FREQ, rows("WID"))
    write(o, 0, flags, [s["PREV_THINK"], s["PREV_STATE"], s["PREV_WORD"]])
    write(o, 0, ins, rows("PREV_IN"))
    write(o, 0, wids, rows("PREV_WID"))
    write(o, 1, keys, rows("KEY"))
    write(o, 2, ins, rows("PREV2_IN"))
    # Layer 1, head 0: the prompt's start state, asked after `<think>` (the one state there).
    q, k, v, o = _projections(w, 1)
    q[KEY_PLANE, s["PREV_THINK"]] = 1
    k[KEY_PLANE, s["IS_STATE"]] = 1
    write(o, 0, value(v, 0, rows("IN")), rows("START"))
    # Layer 2, head 0: the recital, QW against KEYW on the slow planes, copying WID.
    q, k, v, o = _projections(w, 2)
    dims = [p for p in RECITE_PLANES] + [p + half for p in RECITE_PLANES]
    for d, (a, b) in enumerate(zip(rows("QW"), rows("KEYW"), strict=True)):
        q[dims[d], a] = 1
        k[dims[d], b] = 1
    write(o, 0, value(v, 0, rows("WID")), rows("ATT_W"))
    # Layer 3, head 0: once more, ATT_W (the next word) against KEYW, copying the word after it
    # into W2 (its first W2_FREQ frequencies: cos and sin rows of WID), for drafters only.
    q, k, v, o = _projections(w, 3)
    for d, (a, b) in enumerate(zip(rows("ATT_W"), rows("KEYW"), strict=True)):
        q[dims[d], a] = 1
        k[dims[d], b] = 1
    wid = rows("WID")
    first = wid[:W2_FREQ] + wid[N_WORD_FREQ : N_WORD_FREQ + W2_FREQ]
    write(o, 0, value(v, 0, first), rows("W2"))
    return w


def _open_when(gate: np.ndarray, u: int, when: dict[int, int]) -> None:
    """Open unit u's gate (to GATE / 2) when every slot of sign 1 is 1 and every -1 is 0."""
    for slot, sign in when.items():
        gate[u, slot] = sign * GATE
    needed = sum(sign == 1 for sign in when.values())
    gate[u, CITE_SLOTS["BIG"]] = -(needed - 0.5) * GATE / CITE_BIG


class _MLP:
    """One layer's SwiGLU units, added one at a time."""

    def __init__(self, width: int):
        self.gate = np.zeros((width, CITE_HIDDEN))
        self.up = np.zeros((width, CITE_HIDDEN))
        self.down = np.zeros((CITE_HIDDEN, width))
        self.used = 0

    def unit(self, when: dict[int, int], source: int, dest: dict[int, float]) -> None:
        """A unit open `when`, reading slot `source`, writing `dest` (slot -> weight)."""
        u = self.used
        _open_when(self.gate, u, when)
        self.up[u, source] = 1
        for slot, weight in dest.items():
            self.down[slot, u] = weight / (GATE / 2)
        self.used += 1

    def copy(self, when: dict[int, int], source: str, dest: str) -> None:
        for a, b in zip(rows(source), rows(dest), strict=True):
            self.unit(when, a, {b: 1.0})

    def turn(self, t: CiteTarget, when: dict[int, int], source: str, ahead: dict[str, int]):
        """The states `ahead` (slot -> steps) from the state in `source`: one unit per key and
        coordinate, open where the key is that key (and `when`)."""
        for key in range(KEYS):
            turns = {slot: t.turn(steps, key) for slot, steps in ahead.items()}
            for i, row in enumerate(rows(source)):
                dest = {}
                for slot, turned in turns.items():
                    for j, out in enumerate(rows(slot)):
                        dest[out] = turned[j, i]
                self.unit({**when, CITE_SLOTS["KEY"].start + key: 1}, row, dest)


MLP_WIDTH = 4 * KEYS * 2 * CITE_N_FREQ  # layer 3's lookahead, the widest


def _mlp_layers(t: CiteTarget) -> dict[str, np.ndarray]:
    s = CITE_SLOTS
    first_word = {s["IS_WORD"]: 1, s["PREV_WORD"]: -1, s["IS_RECITE"]: -1}
    second_word = {s["IS_WORD"]: 1, s["PREV_WORD"]: 1}
    recited_state = {s["IS_STATE"]: 1, s["PREV_WORD"]: 1}
    layer1 = _MLP(MLP_WIDTH)
    layer1.copy({s["PREV_THINK"]: 1, s["IS_NL"]: 1}, "START", "IN")
    layer1.copy({s["IS_WORD"]: 1}, "PREV_WID", "KEYW")
    layer1.copy(first_word, "WID", "QW")
    # At a second word too (no word comes next there: ATT_W, the word after the next state, is
    # for layer 3 and the drafters, not the head).
    layer1.copy(second_word, "WID", "QW")
    layer1.copy(recited_state, "PREV_WID", "QW")
    layer2 = _MLP(MLP_WIDTH)
    # The next state: after a state of the walk (or the first `<recite>`) from IN; after a second
    # word from the state two back.
    layer2.turn(t, {s["PREV_WORD"]: -1}, "IN", {"OUT": 1})
    layer2.turn(t, second_word, "PREV2_IN", {"OUT": 1})
    layer2.copy(first_word, "ATT_W", "OUTW")
    layer2.copy(recited_state, "ATT_W", "OUTW")
    flags = [
        (
            {s["IS_NL"]: 1, s["PREV_THINK"]: -1, s["PREV_STATE"]: -1, s["PREV_WORD"]: -1},
            "WANT_THINK",
        ),
        ({s["IS_THINK"]: 1}, "WANT_NL"),
        ({s["IS_RECITE"]: 1, s["PREV_WORD"]: 1}, "WANT_NL"),
        ({s["IS_NL"]: 1, s["PREV_WORD"]: 1}, "WANT_THINK_END"),
        ({s["IS_THINK_END"]: 1}, "WANT_NN"),
        ({s["IS_KEY"]: 1}, "WANT_EOS"),
    ] + [({s["IS_NN"]: 1, s["KEY"].start + k: 1}, s["WANT_KEY"].start + k) for k in range(KEYS)]
    for when, flag in flags:
        layer2.unit(when, s["BIG"], {s[flag] if isinstance(flag, str) else flag: 1 / CITE_BIG})
    layer3 = _MLP(MLP_WIDTH)
    _lookahead(t, layer3)
    w = {}
    for layer, mlp in ((1, layer1), (2, layer2), (3, layer3)):
        w[f"model.layers.{layer}.mlp.gate_proj.weight"] = mlp.gate
        w[f"model.layers.{layer}.mlp.up_proj.weight"] = mlp.up
        w[f"model.layers.{layer}.mlp.down_proj.weight"] = mlp.down
    return w


def _lookahead(t: CiteTarget, mlp: _MLP) -> None:
    """The states 2 .. LOOKAHEAD tokens on, where they are states. Phase 1: every token ahead is
    the walk's next. Phase 2 (`n w w n' w w`): after a state, n' is 3 on; after a first word, 2
    on; after a second word, n' is 1 on (OUT, layer 2's) and the state after it 4 on."""
    s = CITE_SLOTS
    mlp.turn(t, {s["PREV_WORD"]: -1, s["IS_WORD"]: -1}, "IN", {"OUT2": 2, "OUT3": 3, "OUT4": 4})
    mlp.turn(t, {s["IS_STATE"]: 1, s["PREV_WORD"]: 1}, "IN", {"OUT3": 1})
    first_word = {s["IS_WORD"]: 1, s["PREV_WORD"]: -1, s["IS_RECITE"]: -1}
    mlp.turn(t, first_word, "PREV_IN", {"OUT2": 1})
    mlp.turn(t, {s["IS_WORD"]: 1, s["PREV_WORD"]: 1}, "PREV2_IN", {"OUT4": 2})


def _lm_head(t: CiteTarget) -> np.ndarray:
    s = CITE_SLOTS
    head = np.zeros((t.vocab, CITE_HIDDEN))
    head[np.ix_(t.state_ids, rows("OUT"))] = STATE_LOGIT * t.state_features(t.states)
    head[t.recite, rows("OUT")] = STATE_LOGIT * t.state_features(np.array([END_STATE]))[0]
    words = t.word_features(np.arange(t.shape.words))
    head[np.ix_(t.word_ids, rows("OUTW"))] = WORD_LOGIT * words[1:]
    head[t.book, rows("OUTW")] = WORD_LOGIT * words[0]
    for token, flag in (
        (t.nl, "WANT_NL"),
        (t.nn, "WANT_NN"),
        (t.think, "WANT_THINK"),
        (t.think_end, "WANT_THINK_END"),
        (t.eos, "WANT_EOS"),
    ):
        head[token, s[flag]] = FLAG_LOGIT
    for key, i in enumerate(t.keys):
        head[i, s["WANT_KEY"].start + key] = FLAG_LOGIT
    return head


def _norm_weights() -> dict[str, np.ndarray]:
    """Every RMSNorm's weight (1: the stream's RMS is ~1) and the q/k norms that set each
    head's scores (long_target._norm_weights: P entries of one size normalise to sqrt(d / P))."""
    norms = {"model.norm.weight": np.ones(CITE_HIDDEN)}
    half, d = HEAD_DIM // 2, HEAD_DIM
    prev = math.sqrt(PREV_SCALE * PREV_PLANES / math.sqrt(d))
    key = math.sqrt(CONTENT_SCORE / math.sqrt(d / (PREV_PLANES + 1)))
    first = np.ones(d)
    first[:PREV_PLANES] = first[half : half + PREV_PLANES] = prev
    first[KEY_PLANE] = first[half + KEY_PLANE] = key
    second = np.ones(d)
    second[KEY_PLANE] = second[half + KEY_PLANE] = math.sqrt(CONTENT_SCORE / math.sqrt(d))
    # Layer 2: q and k are unit Fourier vectors on the slow planes' 2 N_WORD_FREQ entries, so
    # a score is sqrt(d) w^2 cos(angle between the two words' features).
    third = np.ones(d)
    third[RECITE_PLANES] = third[[p + half for p in RECITE_PLANES]] = math.sqrt(
        RECITE_SCORE / math.sqrt(d)
    )
    for layer in range(NUM_LAYERS):
        for name in ("input_layernorm", "post_attention_layernorm"):
            norms[f"model.layers.{layer}.{name}.weight"] = np.ones(CITE_HIDDEN)
        qk = {0: first, 1: second, 2: third, 3: third}.get(layer, np.ones(d))
        for name in ("q_norm", "k_norm"):
            norms[f"model.layers.{layer}.self_attn.{name}.weight"] = qk
    return norms


def write_cite_target(
    shape: CiteShape, vocab_size: int, max_position_embeddings: int, seed: int = 0
) -> tuple:
    """(model, tokenizer, target): the written walker and reciter, float32."""
    tokenizer = cite_tokenizer(shape, vocab_size)
    target = describe(shape, tokenizer, seed)
    weights = {
        "model.embed_tokens.weight": _embedding(target),
        **_attention_layers(),
        **_mlp_layers(target),
        "lm_head.weight": _lm_head(target),
        **_norm_weights(),
    }
    model = written_model(
        tokenizer,
        weights,
        hidden=CITE_HIDDEN,
        intermediate=MLP_WIDTH,
        heads=CITE_HEADS,
        rope_theta=CITE_ROPE_THETA,
        max_position_embeddings=max_position_embeddings,
    )
    return model, tokenizer, target
