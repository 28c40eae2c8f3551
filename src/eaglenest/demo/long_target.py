"""The long-reasoning demo's target, written rather than trained: a Qwen3 causal LM whose weights
are set by hand so that greedy decoding walks long_tasks' chains exactly, answers of up to
nine thousand tokens, each token depending on the one before and on the key in the prompt.

Why written: a tiny target trained here for ten minutes did not learn any long task (the tries in
docs/demo-target.md). A written one is exact at every depth, builds in seconds, and is still an
ordinary Qwen3 checkpoint (RMSNorms, q/k norms, RoPE, SwiGLU) that transformers, the embedded
server and vLLM run like any other; its held-out check decodes it like a trained one.

How it computes (the residual stream has named slots, SLOTS below; a constant slot of
sqrt(HIDDEN) holds the stream's RMS between 1 and 1.2, so every RMSNorm's weight is 1 and a norm
leaves the slots as they are but for a factor per position, which no gate or argmax feels):
- the embedding holds a state's Fourier features (IN: cos and sin of 2π·f·n/STATES for
  FREQUENCIES f), a key's one-hot (KEY_EMB), and flags for the few other tokens the walk uses;
- layer 0, head 0 attends one position back (RoPE's fastest planes, phase-shifted by one
  position) and copies the previous token's flags (PREV_*); head 1 attends the key token, from
  any distance (RoPE's slowest plane barely turns over the context), and copies its one-hot
  (KEY); both read the layer's one key/value head, each its own planes and part of it;
- layer 1, head 0 copies the prompt's start state (START), asked only where the previous token
  is `<think>`, where it is the one state in the context; layer 1's MLP moves it into IN there;
- layer 2's MLP turns IN by the key's step into OUT, the next state: adding a step to a state
  is a rotation of its Fourier features, so OUT = sum over keys of KEY[k] · R(step_k) · IN, one
  SwiGLU unit per key and IN coordinate (gate: that key's KEY, up: the coordinate); other units
  write one flag each for the next special token (`<think>`, `</think>`, ...);
- layer 3's MLP reads the same units into the states further on, OUT2 ... OUT{LOOKAHEAD}
  (R(j · step_k) for the j-th): states the target does not read, but its features hold, as a
  trained target's features hold more than its next token. They make the demo a study of
  drafting several tokens at once: at position t the features hold the states t+1 ... t+4, so
  a drafter's j-th draft step (j <= LOOKAHEAD - 1) can read its answer off the features (a linear
  map) at any depth: EAGLE-3 by carrying the later slots in its own hidden state from step to
  step, P-EAGLE and DFlash by each drafted position reading its own slot. A draft past
  LOOKAHEAD - 1 steps would need the key's rotation, a product, which no drafter learns from
  the demo's data (the first written target had only OUT, and its drafter reached 0.15 held-out
  accuracy; the second had OUT2 alone, and capped every drafter at its first draft step:
  acceptance ~2.0 at K=3 and K=7 alike);
- the LM head scores each state by OUT's Fourier features (a peak of N_FREQ at the state, under
  0.41 of it elsewhere); END_STATE's features are the newline's, so the walk ends by itself.
Layer 4 is the identity (zero output projections): the EAGLE-3 aux layers (2, 3, 4), the outputs
of layers 1, 2 and 3, hold the current state, the next one, and the next LOOKAHEAD.

The slot budget (HIDDEN 512): six state slots of 2 · N_FREQ (IN, START, OUT ... OUT4) and 37
flags; N_FREQ 39 keeps the LM head's margin (the best wrong state under 0.41 of the right one;
47, the second target's, would need a hidden size of 640, and every drafter's layer and LM head
with it). The MLPs are 640 units wide (8 keys × 78 coordinates, and the flags).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from eaglenest.common.reasoning import THINK_END, THINK_START
from eaglenest.demo.long_tasks import (
    END_STATE,
    KEYS,
    STATES,
    STEPS,
    chain_example,
    key_token,
    state_token,
)
from eaglenest.demo.tasks import END_OF_TURN
from eaglenest.demo.written import (
    AHEAD,
    CONTENT_SCORE,
    FLAG_LOGIT,
    GATE,
    HEAD_DIM,
    KEY_PLANE,
    KV_HEADS,
    LOOKAHEAD,
    NUM_LAYERS,
    PREV_PLANES,
    PREV_SCALE,
    STATE_LOGIT,
    fourier,
    rotation,
    written_model,
)

MLP_LAYER = 2  # the next state's layer (aux 3 is its output); aux 4 holds the states after it
HIDDEN = 512
# Two query heads of 128 sharing one key/value head: all the attention the walk needs (layer 0:
# the previous token and the key; layer 1: the start), and a KV cache of 256 numbers a position
# and layer instead of 1,024 for 8 heads of 64: decoding 9,000 tokens reads the cache at every
# step, and that reading is most of the long demo's generation time.
HEADS = 2
N_FREQ = 39  # Fourier frequencies of a state: six slots of 2 * N_FREQ (IN, START, OUT ... OUT4)
ROPE_THETA = 1_000_000.0
# The constant slot: the stream's RMS is about 1 (1.0 to 1.2 with the other slots), so every
# RMSNorm's weight is 1 as in a trained model, and a drafter that starts from the target's final
# norm and LM head starts from logits of a usual scale.
BIG = math.sqrt(HIDDEN)


def _slots() -> dict[str, slice | int]:
    names: list[tuple[str, int]] = [
        ("IN", 2 * N_FREQ),
        *((ahead, 2 * N_FREQ) for ahead in AHEAD),
        ("START", 2 * N_FREQ),
        ("KEY", KEYS),
        ("KEY_EMB", KEYS),
        ("IS_NL", 1),
        ("IS_THINK", 1),
        ("IS_STATE", 1),
        ("IS_THINK_END", 1),
        ("IS_NN", 1),
        ("IS_KEY", 1),
        ("PREV_THINK", 1),
        ("PREV_STATE", 1),
        ("WANT_THINK", 1),
        ("WANT_NL", 1),
        ("WANT_THINK_END", 1),
        ("WANT_NN", 1),
        ("WANT_EOS", 1),
        ("WANT_KEY", KEYS),
    ]
    slots: dict[str, slice | int] = {}
    at = 0
    for name, size in names:
        slots[name] = at if size == 1 else slice(at, at + size)
        at += size
    assert at < HIDDEN - 1
    slots["BIG"] = HIDDEN - 1
    return slots


SLOTS = _slots()


def frequencies(seed: int = 0) -> np.ndarray:
    """N_FREQ frequencies whose Fourier features tell every two states apart by a wide margin
    (checked in the tests: the best wrong state scores under 0.34 of the right one)."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(np.arange(1, STATES // 2), size=N_FREQ, replace=False))


def long_tokenizer(vocab_size: int) -> Any:
    """The demo tokenizer (byte-level BPE, Qwen3's specials and template), trained on the
    prompts' words, with every state and key as one added token."""
    from tokenizers import AddedToken

    from eaglenest.demo.target_tokenizer import build_demo_tokenizer

    words = [chain_example(k, 4).prompt for k in range(KEYS)] + ["\n\n" + key_token(0)]
    corpus = ["user\nassistant\nsystem\n"] * 8 + words * 8
    tokenizer = build_demo_tokenizer(corpus, vocab_size)
    names = [state_token(n) for n in range(STATES) if n != END_STATE]
    names += [key_token(k) for k in range(KEYS)]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in names])
    return tokenizer


def _rope_inv_freq() -> np.ndarray:
    return ROPE_THETA ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)


@dataclass(frozen=True)
class _Ids:
    """The token ids the weights are written for."""

    vocab: int
    states: np.ndarray  # the states with a token (END_STATE has none)
    state_ids: np.ndarray
    keys: list[int]
    nl: int
    nn: int
    think: int
    think_end: int
    eos: int

    @classmethod
    def of(cls, tokenizer: Any) -> _Ids:
        tid = tokenizer.convert_tokens_to_ids
        nl, nn = tokenizer.encode("\n"), tokenizer.encode("\n\n")
        assert len(nl) == 1 and len(nn) == 1, (nl, nn)
        states = np.array([n for n in range(STATES) if n != END_STATE])
        return cls(
            vocab=len(tokenizer),
            states=states,
            state_ids=np.array([tid(state_token(n)) for n in states]),
            keys=[tid(key_token(k)) for k in range(KEYS)],
            nl=nl[0],
            nn=nn[0],
            think=tid(THINK_START),
            think_end=tid(THINK_END),
            eos=tid(END_OF_TURN),
        )


def _rows(name: str) -> list[int]:
    return list(range(SLOTS[name].start, SLOTS[name].stop))


def _embedding(ids: _Ids, freqs: np.ndarray) -> np.ndarray:
    s = SLOTS
    embed = np.zeros((ids.vocab, HIDDEN))
    embed[:, s["BIG"]] = BIG
    embed[np.ix_(ids.state_ids, _rows("IN"))] = fourier(ids.states, freqs)
    embed[ids.state_ids, s["IS_STATE"]] = 1
    for key, i in enumerate(ids.keys):
        embed[i, s["KEY_EMB"].start + key] = 1
        embed[i, s["IS_KEY"]] = 1
    for token, flag in (
        (ids.nl, "IS_NL"),
        (ids.nn, "IS_NN"),
        (ids.think, "IS_THINK"),
        (ids.think_end, "IS_THINK_END"),
    ):
        embed[token, s[flag]] = 1
    return embed


def _attention_layers() -> dict[str, np.ndarray]:
    """Layers 0 and 1's q, k, v and o projections (the other layers' are zero). Each layer has
    one key/value head that both query heads read; a head looks only at its own planes of the
    key and writes only its own part of the value."""
    s = SLOTS
    w: dict[str, np.ndarray] = {}

    def attention(layer: int) -> tuple[np.ndarray, ...]:
        shapes = {
            "q_proj": (HEADS * HEAD_DIM, HIDDEN),
            "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
            "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
            "o_proj": (HIDDEN, HEADS * HEAD_DIM),
        }
        for name, shape in shapes.items():
            w[f"model.layers.{layer}.self_attn.{name}.weight"] = np.zeros(shape)
        return tuple(w[f"model.layers.{layer}.self_attn.{name}.weight"] for name in shapes)

    def copy(v, o, head: int, at: int, source: list[int], dest: list[int]) -> None:
        """Head `head` writes value rows at, at + 1, ... (from `source`) into `dest`."""
        for i, (a, b) in enumerate(zip(source, dest, strict=True)):
            v[at + i, a] = 1
            o[b, head * HEAD_DIM + at + i] = 1

    half = HEAD_DIM // 2
    theta = _rope_inv_freq()
    q, k, v, o = attention(0)
    # Head 0: one position back. q holds 1 in each fast plane's first coordinate, k the same
    # turned by one position, so a score is sum cos(theta * (1 - distance)).
    for j in range(PREV_PLANES):
        q[j, s["BIG"]] = 1 / BIG
        k[j, s["BIG"]] = math.cos(theta[j]) / BIG
        k[j + half, s["BIG"]] = math.sin(theta[j]) / BIG
    copy(v, o, 0, 0, [s["IS_THINK"], s["IS_STATE"]], [s["PREV_THINK"], s["PREV_STATE"]])
    # Head 1: the key token, wherever it is (its one-hot), found in the slowest plane.
    q[HEAD_DIM + KEY_PLANE, s["BIG"]] = 1 / BIG
    k[KEY_PLANE, s["IS_KEY"]] = 1
    copy(v, o, 1, 2, _rows("KEY_EMB"), _rows("KEY"))
    # Layer 1, head 0: the prompt's start state, asked after `<think>` (the walk's first
    # token), where it is the one state in the context.
    q, k, v, o = attention(1)
    q[KEY_PLANE, s["PREV_THINK"]] = 1
    k[KEY_PLANE, s["IS_STATE"]] = 1
    copy(v, o, 0, 0, _rows("IN"), _rows("START"))
    return w


def _open_when(gate: np.ndarray, u: int, slots: dict[int, int]) -> None:
    """Open unit u's gate (to GATE / 2) when every slot is 1 (0 where its sign is -1)."""
    for slot, sign in slots.items():
        gate[u, slot] = sign * GATE
    needed = sum(sign == 1 for sign in slots.values())
    gate[u, SLOTS["BIG"]] = -(needed - 0.5) * GATE / BIG


def _mlp_layers(freqs: np.ndarray) -> dict[str, np.ndarray]:
    """Layers 1, 2 and 3's SwiGLU units (silu(gate) * up, written out by down); the other
    layers' are zero."""
    s = SLOTS
    opened = GATE / 2  # an open gate's silu, divided out by down
    flags = [
        ({s["IS_NL"]: 1, s["PREV_THINK"]: -1, s["PREV_STATE"]: -1}, s["WANT_THINK"]),
        ({s["IS_THINK"]: 1}, s["WANT_NL"]),
        ({s["IS_NL"]: 1, s["PREV_STATE"]: 1}, s["WANT_THINK_END"]),
        ({s["IS_THINK_END"]: 1}, s["WANT_NN"]),
        ({s["IS_KEY"]: 1}, s["WANT_EOS"]),
    ] + [
        ({s["IS_NN"]: 1, s["KEY"].start + key: 1}, s["WANT_KEY"].start + key) for key in range(KEYS)
    ]
    ins = _rows("IN")
    width = -(-(KEYS * len(ins) + len(flags)) // 32) * 32  # every layer's MLP: one config size

    def zeros() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.zeros((width, HIDDEN)), np.zeros((width, HIDDEN)), np.zeros((HIDDEN, width))

    def turn(gate, up, down, ahead: list[int]) -> int:
        """The states `ahead` steps on (AHEAD[j - 1] for j in ahead) from IN: one unit per key
        and IN coordinate, open where KEY is that key, its product with the coordinate written
        out by that key's rotation of j steps; returns the units used."""
        u = 0
        for key in range(KEYS):
            turns = {j: rotation(j * STEPS[key], freqs) for j in ahead}
            for i, row in enumerate(ins):
                _open_when(gate, u, {s["KEY"].start + key: 1})
                up[u, row] = 1
                for j, turned in turns.items():
                    down[_rows(AHEAD[j - 1]), u] = turned[:, i] / opened
                u += 1
        return u

    starts = _rows("START")
    # Layer 1 (after its attention copied START): at the walk's first token, START into IN.
    gate, up, down = zeros()
    for u in range(2 * N_FREQ):
        _open_when(gate, u, {s["PREV_THINK"]: 1, s["IS_NL"]: 1})
        up[u, starts[u]] = 1
        down[ins[u], u] = 1 / opened
    mlp = {1: (gate, up, down)}
    # Layer 2: OUT, the next state, and the flags of the next special token.
    gate, up, down = zeros()
    u = turn(gate, up, down, [1])
    for slots, target in flags:
        _open_when(gate, u, slots)
        up[u, s["BIG"]] = 1 / BIG
        down[target, u] = 1 / opened
        u += 1
    mlp[2] = (gate, up, down)
    # Layer 3: OUT2 ... OUT{LOOKAHEAD}, the states after next, for the drafters.
    gate, up, down = zeros()
    turn(gate, up, down, list(range(2, LOOKAHEAD + 1)))
    mlp[3] = (gate, up, down)
    w = {}
    for layer, (gate, up, down) in mlp.items():
        w[f"model.layers.{layer}.mlp.gate_proj.weight"] = gate
        w[f"model.layers.{layer}.mlp.up_proj.weight"] = up
        w[f"model.layers.{layer}.mlp.down_proj.weight"] = down
    return w


def _lm_head(ids: _Ids, freqs: np.ndarray) -> np.ndarray:
    s = SLOTS
    head = np.zeros((ids.vocab, HIDDEN))
    outs = _rows("OUT")
    head[np.ix_(ids.state_ids, outs)] = STATE_LOGIT * fourier(ids.states, freqs)
    head[ids.nl, outs] = STATE_LOGIT * fourier(np.array([END_STATE]), freqs)[0]
    for token, flag in (
        (ids.nl, "WANT_NL"),
        (ids.nn, "WANT_NN"),
        (ids.think, "WANT_THINK"),
        (ids.think_end, "WANT_THINK_END"),
        (ids.eos, "WANT_EOS"),
    ):
        head[token, s[flag]] = FLAG_LOGIT
    for key, i in enumerate(ids.keys):
        head[i, s["WANT_KEY"].start + key] = FLAG_LOGIT
    return head


def _weights(tokenizer: Any, freqs: np.ndarray) -> dict[str, np.ndarray]:
    """Every tensor of the model that is not zero or a norm, by its state-dict name."""
    ids = _Ids.of(tokenizer)
    return {
        "model.embed_tokens.weight": _embedding(ids, freqs),
        **_attention_layers(),
        **_mlp_layers(freqs),
        "lm_head.weight": _lm_head(ids, freqs),
    }


def _norm_weights() -> dict[str, np.ndarray]:
    """Every RMSNorm's weight: the stream's RMS, so a norm leaves the slots as they are; the
    heads' q/k norms set their scores. A q or k with P entries of one size normalises them to
    sqrt(HEAD_DIM / P), and a score is q.k / sqrt(HEAD_DIM)."""
    rms = BIG / math.sqrt(HIDDEN)  # 1
    norms = {"model.norm.weight": np.full(HIDDEN, rms)}
    half = HEAD_DIM // 2
    d = HEAD_DIM
    # Layer 0. The previous-token head: P fast planes in q and k, entries sqrt(d/P) w each, so a
    # score is sqrt(d)/P w^2 sum(cos). The key head: one entry in q (sqrt(d) w), and at the key
    # token one in k beside the P planes' (sqrt(d/(P+1)) w): a score of sqrt(d/(P+1)) w^2.
    prev = math.sqrt(PREV_SCALE * PREV_PLANES / math.sqrt(d))
    key = math.sqrt(CONTENT_SCORE / math.sqrt(d / (PREV_PLANES + 1)))
    first = np.ones(d)
    first[:PREV_PLANES] = first[half : half + PREV_PLANES] = prev
    first[KEY_PLANE] = first[half + KEY_PLANE] = key
    # Layer 1, the start head: one entry in q and in k, a score of sqrt(d) w^2.
    second = np.ones(d)
    second[KEY_PLANE] = second[half + KEY_PLANE] = math.sqrt(CONTENT_SCORE / math.sqrt(d))
    for layer in range(NUM_LAYERS):
        for name in ("input_layernorm", "post_attention_layernorm"):
            norms[f"model.layers.{layer}.{name}.weight"] = np.full(HIDDEN, rms)
        qk = {0: first, 1: second}.get(layer, np.ones(d))
        for name in ("q_norm", "k_norm"):
            norms[f"model.layers.{layer}.self_attn.{name}.weight"] = qk
    return norms


def write_long_target(vocab_size: int, max_position_embeddings: int, seed: int = 0) -> tuple:
    """(model, tokenizer): the written chain walker, float32."""
    tokenizer = long_tokenizer(vocab_size)
    freqs = frequencies(seed)
    weights = {**_weights(tokenizer, freqs), **_norm_weights()}
    model = written_model(
        tokenizer,
        weights,
        hidden=HIDDEN,
        intermediate=weights[f"model.layers.{MLP_LAYER}.mlp.gate_proj.weight"].shape[0],
        heads=HEADS,
        rope_theta=ROPE_THETA,
        max_position_embeddings=max_position_embeddings,
    )
    return model, tokenizer
