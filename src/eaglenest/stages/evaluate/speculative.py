"""Greedy speculative decoding with a transformers target, as serving engines do it.

Each round a proposer drafts K tokens; the target verifies them in ONE forward pass over
[last token, d1..dK]; the longest prefix of drafts equal to the target's greedy tokens is
accepted, plus the target's own next token (the "bonus" token). Acceptance length of a round =
accepted drafts + 1, the figure vLLM and SGLang report. The output is, by construction, the
target's greedy output; `greedy_generate` is the reference it is checked against.

Decoding stops at the first end-of-turn token wherever it lands in a round (an accepted draft or
the bonus token), and at max_new_tokens. Only what lies inside the output is counted: in the last
round, drafts past the end of the output are neither accepted nor drafted, and no later round
runs or is timed. (vLLM's counters take a request's last round whole, before its stop check, so
they can count drafts accepted past the end of turn in that one round.)

Every run starts from a `Prefill` of its prompt, which the runs of one prompt share (greedy and
each proposer and K; each decodes on a copy of its cache, and counts the prefill's seconds in its
own): at a depth of 8,192 tokens the prefill is most of a run's cost. The cache is the growing one
(eaglenest.target_model.kv_cache), whose step does not copy the whole context.

Proposers: `EagleProposer` (the EAGLE-3 drafter, fed the target's aux hidden states of every
verified position, with its own KV cache), `PromptLookupProposer` (n-gram lookup in the
context, the usual training-free baseline), `ContinuationProposer` (a written target's oracle:
the held-out sample's own next tokens), and the one-forward families' of
parallel_proposers.py (P-EAGLE, DFlash). A run also times the drafter's own share (`draft_s`:
its `propose` and `accept` calls, the work vLLM's proposer does between verifications), since a
family that drafts K tokens in one forward spends less there than EAGLE-3's K steps.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from eaglenest.drafter.eagle3.model import Eagle3Drafter
from eaglenest.drafter.layers import DecodeCache
from eaglenest.target_model.kv_cache import growing_cache


@dataclass
class Generation:
    tokens: list[int]
    target_forwards: int
    wall_s: float
    accept_lengths: list[int] = field(default_factory=list)  # per verification round
    # Drafts per round that lie inside the output (all of them but in the last round).
    draft_lengths: list[int] = field(default_factory=list)
    draft_s: float = 0.0  # in the proposer's propose and accept calls
    draft_start_s: float = 0.0  # in its start: the drafter over the prompt, once a run

    def accepted_per_position(self, k: int) -> list[int]:
        """Rounds whose draft at position i (0-based) was accepted; acceptance is a prefix."""
        return [sum(a - 1 > i for a in self.accept_lengths) for i in range(k)]

    def drafted_per_position(self, k: int) -> list[int]:
        return [sum(d > i for d in self.draft_lengths) for i in range(k)]


def _target_forward(target, ids: list[int], cache, layer_ids, device):
    out = target(
        input_ids=torch.tensor([ids], device=device),
        cache=cache,
        use_cache=True,
        output_hidden_states=layer_ids is not None,
    )
    aux = None
    if layer_ids is not None:
        # hidden_states[k] is the INPUT of decoder layer k: the convention of the hidden stage.
        aux = torch.cat([out.hidden_states[k][0] for k in layer_ids], dim=-1)
    return out.logits[0], aux


@dataclass
class Prefill:
    """The target's forward over a prompt, which every run from that prompt starts with."""

    logits: torch.Tensor  # the last position's
    aux: torch.Tensor | None  # the aux states of every position (None without layer_ids)
    cache: Any  # a DynamicCache; each run decodes on its own copy
    wall_s: float

    @classmethod
    @torch.inference_mode()
    def of(cls, target, prompt: list[int], layer_ids) -> Prefill:
        device = next(target.parameters()).device
        started = time.perf_counter()
        cache = growing_cache(target)
        logits, aux = _target_forward(target, prompt, cache, layer_ids, device)
        return cls(logits[-1], aux, cache, time.perf_counter() - started)

    def own_cache(self) -> Any:
        return copy.deepcopy(self.cache)


def _inside_output(new: list[int], room: int, eos_ids: set[int]) -> list[int]:
    """A round's new tokens cut at max_new_tokens and after the first end-of-turn token."""
    new = new[:room]
    for i, token in enumerate(new):
        if token in eos_ids:
            return new[: i + 1]
    return new


@torch.inference_mode()
def greedy_generate(
    target,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: set[int],
    prefill: Prefill | None = None,
) -> Generation:
    device = next(target.parameters()).device
    prefill = prefill or Prefill.of(target, prompt, None)
    started = time.perf_counter()
    cache = prefill.own_cache()
    tokens = [int(prefill.logits.argmax())]
    forwards = 1
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        logits, _ = _target_forward(target, tokens[-1:], cache, None, device)
        tokens.append(int(logits[-1].argmax()))
        forwards += 1
    return Generation(tokens, forwards, prefill.wall_s + time.perf_counter() - started)


class Proposer(Protocol):
    """What `speculative_generate` asks of a drafter: `start` after the prompt's prefill (its
    aux states [T, n_aux·H] when `needs_hidden`, and the target's first token), `propose(k)`
    drafts, `accept` the round's new tokens with the aux states of the positions verified."""

    needs_hidden: bool

    def start(self, prompt: list[int], aux: torch.Tensor | None, first_token: int) -> None: ...

    def propose(self, k: int) -> list[int]: ...

    def accept(self, new_tokens: list[int], aux: torch.Tensor | None) -> None: ...


class EagleProposer:
    """The drafter keeps step-0 keys of every verified position; each round's chain is dropped."""

    needs_hidden = True

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.device = drafter.fc.weight.device

    def _extend(self, next_tokens: list[int], aux: torch.Tensor) -> None:
        # Position p takes the target's aux state at p and the token at p + 1.
        n = len(next_tokens)
        positions = torch.arange(self.length, self.length + n, device=self.device)[None]
        hidden = self.drafter.project(aux[None].to(self.device))
        ids = torch.tensor([next_tokens], device=self.device)
        logits, hidden = self.drafter.step(ids, hidden, positions, self.cache)
        self.length += n
        self.logits, self.hidden = logits[0, -1], hidden[:, -1:]

    def start(self, prompt: list[int], aux: torch.Tensor, first_token: int) -> None:
        self.cache = DecodeCache()
        self.length = 0
        self._extend([*prompt[1:], first_token], aux)

    def propose(self, k: int) -> list[int]:
        drafts: list[int] = []
        logits, hidden = self.logits, self.hidden
        for j in range(k):
            token = int(self.drafter.draft_to_target(logits.argmax()))
            drafts.append(token)
            if j + 1 == k:
                break
            position = torch.tensor([[self.length - 1 + j + 1]], device=self.device)
            ids = torch.tensor([[token]], device=self.device)
            step_logits, hidden = self.drafter.step(ids, hidden, position, self.cache)
            logits = step_logits[0, -1]
        self.cache.truncate(self.length)
        return drafts

    def accept(self, new_tokens: list[int], aux: torch.Tensor) -> None:
        self._extend(new_tokens, aux)


class PromptLookupProposer:
    """Drafts the tokens that followed the latest earlier occurrence of the context's last n-gram
    (n from `max_ngram` down to 1); nothing when there is none."""

    needs_hidden = False

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def start(self, prompt: list[int], aux, first_token: int) -> None:
        self.tokens = [*prompt, first_token]

    def propose(self, k: int) -> list[int]:
        return prompt_lookup(self.tokens, k, self.max_ngram)

    def accept(self, new_tokens: list[int], aux) -> None:
        self.tokens.extend(new_tokens)


class ContinuationProposer:
    """The oracle of a written target (demo/long_target.py, demo/cite_target.py): drafts the
    held-out sample's own next tokens. Such a target's greedy answer is its sample, token for
    token, so every draft is accepted (K + 1 a round) at every depth; a round below that is the
    target or the engine, not the text being harder there."""

    needs_hidden = False

    def __init__(self, samples: list[list[int]]):
        self.samples = samples
        self.ids: list[int] = []
        self.at = 0

    def start(self, prompt: list[int], aux, first_token: int) -> None:
        found = [s for s in self.samples if s[: len(prompt)] == prompt and len(s) > len(prompt)]
        if not found:
            raise ValueError("the oracle has no held-out sample this prompt was cut from")
        self.ids, self.at = found[0], len(prompt) + 1

    def propose(self, k: int) -> list[int]:
        return list(self.ids[self.at : self.at + k])

    def accept(self, new_tokens: list[int], aux) -> None:
        self.at += len(new_tokens)


def prompt_lookup(context: list[int], k: int, max_ngram: int) -> list[int]:
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                return context[start + n : start + n + k]
    return []


@torch.inference_mode()
def speculative_generate(
    target,
    proposer: Proposer,
    prompt: list[int],
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
    layer_ids: list[int] | tuple[int, ...],
    prefill: Prefill | None = None,
) -> Generation:
    """`prefill`: the prompt's, with the aux states of `layer_ids` (made here when None)."""
    device = next(target.parameters()).device
    layers = layer_ids if proposer.needs_hidden else None
    prefill = prefill or Prefill.of(target, prompt, layers)
    started = time.perf_counter() - prefill.wall_s
    cache = prefill.own_cache()
    tokens = [int(prefill.logits.argmax())]
    forwards = 1
    tick = time.perf_counter()
    proposer.start(prompt, prefill.aux if layers is not None else None, tokens[0])
    draft_start_s = time.perf_counter() - tick
    accept_lengths: list[int] = []
    draft_lengths: list[int] = []
    draft_s = 0.0
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        tick = time.perf_counter()
        drafts = proposer.propose(k)
        draft_s += time.perf_counter() - tick
        logits, aux = _target_forward(target, [tokens[-1], *drafts], cache, layers, device)
        forwards += 1
        greedy = logits.argmax(-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == greedy[n]:
            n += 1
        if n < len(drafts):
            # Drop the rejected drafts' entries (transformers wants a negative count).
            cache.crop(-(len(drafts) - n))
        new = _inside_output([*drafts[:n], greedy[n]], max_new_tokens - len(tokens), eos_ids)
        tokens.extend(new)
        ended = len(tokens) >= max_new_tokens or new[-1] in eos_ids
        accept_lengths.append(min(n, len(new)) + 1)
        draft_lengths.append(min(len(drafts), len(new)) if ended else len(drafts))
        if ended:
            break
        tick = time.perf_counter()
        proposer.accept(new, aux[: n + 1] if aux is not None else None)
        draft_s += time.perf_counter() - tick
    wall_s = time.perf_counter() - started
    return Generation(
        tokens, forwards, wall_s, accept_lengths, draft_lengths, draft_s, draft_start_s
    )
