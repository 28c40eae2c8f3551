"""The engine's figures prompt by prompt, from vLLM's per-request record
(`per_request_spec_decode_metrics: detailed`, v1/metrics/stats.py RequestSpecDecodeMetrics: each
request's accepted and drafted draft tokens per verification step, in order): their spread over
prompts, and acceptance by generated position.

**Spread.** One acceptance length over all prompts cannot say whether a difference is real: a
few long, easy answers weigh as much as many short ones. Per prompt, acceptance length = 1 +
accepted / steps; `spread` holds their quartiles and a 95 % bootstrap interval of the pooled
figure (prompts drawn with replacement, 1 + accepted / steps of each draw; seeded, so the same
answers give the same interval). A sampled figure also carries its difference from the greedy
one on the same prompts (`vs_greedy`), paired: each draw takes the same prompts from both, so
the prompts' own difficulty cancels out of the interval.

**By generated position.** The prefill emits the answer's position 0; a step that accepts a
drafts emits a + 1 tokens, so step i drafts for the positions from 1 + sum over j < i of
(accepted_j + 1) on. Steps are binned by that start (POSITION_BINS bins over the answer's
max_new_tokens): acceptance inside the engine's own answer, without cutting samples (the
cut-at-depth figures, depths.py, move the start of the answer instead). vLLM records no step it
scheduled no drafts for; with the room the engines get (vllm_evaluate.draft_room) every step
drafts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
POSITION_BINS = 8


def prompt_lengths(per_step_accepted: list[list[int]]) -> list[float | None]:
    """Each prompt's acceptance length, 1 + accepted / steps (None: no step, nothing drafted)."""
    return [1 + sum(steps) / len(steps) if steps else None for steps in per_step_accepted]


def _totals(per_step_accepted: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    accepted = np.array([sum(steps) for steps in per_step_accepted], dtype=np.float64)
    steps = np.array([len(steps) for steps in per_step_accepted], dtype=np.float64)
    return accepted, steps


def _draws(prompts: int, seed: int) -> np.ndarray:
    """The bootstrap's draws of prompt indices (one row a resample), the same for a seed."""
    return np.random.default_rng(seed).integers(0, prompts, size=(BOOTSTRAP_RESAMPLES, prompts))


def _pooled(accepted: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """1 + accepted / steps of each resample (rows), 1 where a resample has no step."""
    totals = steps.sum(axis=-1)
    return 1 + accepted.sum(axis=-1) / np.where(totals > 0, totals, 1)


def _interval(values: np.ndarray) -> list[float]:
    return [round(float(v), 4) for v in np.percentile(values, [2.5, 97.5])]


def prompt_spread(per_step_accepted: list[list[int]], seed: int) -> dict[str, Any] | None:
    """The figure's spread over prompts: the pooled acceptance length (the counters' figure,
    from the per-request record), its 95 % bootstrap interval, the per-prompt lengths and their
    quartiles. None without prompts."""
    if not per_step_accepted:
        return None
    accepted, steps = _totals(per_step_accepted)
    lengths = [length for length in prompt_lengths(per_step_accepted) if length is not None]
    quartiles = np.quantile(lengths, [0.0, 0.25, 0.5, 0.75, 1.0]) if lengths else [None] * 5
    draws = _draws(len(accepted), seed)
    return {
        "prompts": len(per_step_accepted),
        "acceptance_length": float(_pooled(accepted, steps)),
        "ci95": _interval(_pooled(accepted[draws], steps[draws])),
        "resamples": BOOTSTRAP_RESAMPLES,
        **dict(zip(("min", "q1", "median", "q3", "max"), map(_rounded, quartiles), strict=True)),
        "per_prompt": [_rounded(length) for length in prompt_lengths(per_step_accepted)],
    }


def paired_difference(
    sampled: list[list[int]], greedy: list[list[int]], seed: int
) -> dict[str, Any] | None:
    """Sampled minus greedy acceptance length over the same prompts, with its paired 95 %
    bootstrap interval (each draw the same prompts on both sides). None unless both answered
    the same number of prompts."""
    if not sampled or len(sampled) != len(greedy):
        return None
    (sampled_accepted, sampled_steps), (greedy_accepted, greedy_steps) = (
        _totals(sampled),
        _totals(greedy),
    )
    draws = _draws(len(sampled), seed)
    differences = _pooled(sampled_accepted[draws], sampled_steps[draws]) - _pooled(
        greedy_accepted[draws], greedy_steps[draws]
    )
    difference = _pooled(sampled_accepted, sampled_steps) - _pooled(greedy_accepted, greedy_steps)
    return {"difference": float(difference), "ci95": _interval(differences)}


def by_position(
    per_step_accepted: list[list[int]],
    per_step_drafted: list[list[int]],
    max_new_tokens: int,
    bins: int = POSITION_BINS,
) -> dict[str, Any]:
    """Acceptance by the answer's position where each step starts drafting, in `bins` bins of
    equal width over max_new_tokens: per bin the steps, accepted and drafted tokens, acceptance
    length (1 + accepted / steps) and the share of drafts accepted."""
    width = max(1, math.ceil(max_new_tokens / bins))
    count = math.ceil(max_new_tokens / width)
    steps, accepted, drafted = [0] * count, [0] * count, [0] * count
    for accepted_steps, drafted_steps in zip(per_step_accepted, per_step_drafted, strict=True):
        position = 1  # the prefill emitted position 0
        for step_accepted, step_drafted in zip(accepted_steps, drafted_steps, strict=True):
            index = min(position // width, count - 1)
            steps[index] += 1
            accepted[index] += step_accepted
            drafted[index] += step_drafted
            position += step_accepted + 1
    rows = [
        {
            "start": index * width,
            "end": min((index + 1) * width, max_new_tokens),
            "steps": steps[index],
            "accepted": accepted[index],
            "drafted": drafted[index],
            "acceptance_length": 1 + accepted[index] / steps[index] if steps[index] else None,
            "draft_acceptance": accepted[index] / drafted[index] if drafted[index] else None,
        }
        for index in range(count)
    ]
    return {
        "bin_tokens": width,
        "bins": rows,
        "definition": (
            "vLLM's per-request steps binned by the answer position each starts drafting at "
            "(1 + the tokens its earlier steps emitted); acceptance length = 1 + accepted / steps"
        ),
    }


def record_figures(answer: dict[str, Any], max_new_tokens: int, seed: int) -> dict[str, Any]:
    """`spread` and `by_position` of one engine answer, from its per-request record; {} for an
    answer without one (plain decoding, or an engine that returned none)."""
    per_step_accepted = answer.get("per_step_accepted")
    per_step_drafted = answer.get("per_step_drafted")
    if per_step_accepted is None or per_step_drafted is None:
        return {}
    return {
        "spread": prompt_spread(per_step_accepted, seed),
        "by_position": by_position(per_step_accepted, per_step_drafted, max_new_tokens),
    }


def _rounded(value: Any) -> float | None:
    return None if value is None else round(float(value), 4)
