"""The engine's figures prompt by prompt (stages/evaluate/spread.py, from vLLM's per-request
per-step record): the spread over prompts with a seeded bootstrap interval, the paired
difference of sampled from greedy, acceptance binned by generated position; the greedy figures
of an answer decoded greedily and sampled stay what acceptance() makes of it, and the sampled
ones say their temperature (vllm_evaluate.figures_at_temperatures); what the engine process is
asked to sample with (vllm_engine/decode.py)."""

from __future__ import annotations

import pytest

from eaglenest.stages.evaluate.spread import (
    BOOTSTRAP_RESAMPLES,
    by_position,
    paired_difference,
    prompt_lengths,
    prompt_spread,
    record_figures,
)
from eaglenest.stages.evaluate.vllm_evaluate import (
    Sampling,
    acceptance,
    figures_at_temperatures,
    in_brief,
)
from eaglenest.vllm_engine.decode import sampling_arguments

# Four prompts' accepted drafts per step (K=3): easy, medium, hard, one step only.
STEPS = [[3, 3, 2, 3], [1, 2, 1, 0, 2], [0, 0, 1, 0, 0, 0], [2]]


def test_the_spread_gives_the_per_prompt_lengths_their_quartiles_and_a_seeded_interval():
    assert prompt_lengths(STEPS) == [pytest.approx(1 + 11 / 4), 2.2, pytest.approx(7 / 6), 3.0]
    assert prompt_lengths([[], [1]]) == [None, 2.0]
    spread = prompt_spread(STEPS, seed=7)
    # The pooled figure is the counters' definition: 1 + every accepted draft / every step.
    assert spread["acceptance_length"] == pytest.approx(1 + 20 / 16)
    assert spread["prompts"] == 4 and spread["resamples"] == BOOTSTRAP_RESAMPLES
    assert (spread["min"], spread["max"]) == (pytest.approx(7 / 6, abs=1e-4), 3.75)
    assert spread["min"] < spread["q1"] < spread["median"] < spread["q3"] < spread["max"]
    assert spread["median"] == pytest.approx((2.2 + 3.0) / 2)
    low, high = spread["ci95"]
    assert 7 / 6 <= low < spread["acceptance_length"] < high <= 3.75
    assert prompt_spread(STEPS, seed=7) == spread  # the same seed, the same interval
    # More prompts alike narrow the interval.
    narrow = prompt_spread(STEPS * 25, seed=7)["ci95"]
    assert narrow[1] - narrow[0] < (high - low) / 2
    assert prompt_spread([], seed=7) is None


def test_a_sampled_figure_is_compared_with_greedy_on_the_same_prompts_paired():
    same = paired_difference(STEPS, STEPS, seed=3)
    assert same == {"difference": 0.0, "ci95": [0.0, 0.0]}
    # One draft fewer accepted on every step of every prompt: prompts as unlike as these still
    # leave an interval below 0, as each draw takes the same prompts from both sides.
    fewer = [[max(a - 1, 0) for a in steps] for steps in STEPS]
    lower = paired_difference(fewer, STEPS, seed=3)
    assert lower["difference"] < 0 and lower["ci95"][1] < 0
    assert paired_difference(STEPS[:3], STEPS, seed=3) is None
    assert paired_difference([], [], seed=3) is None


def test_steps_are_binned_by_the_position_they_start_drafting_at():
    # Prompt 1 emits position 0 in the prefill; its steps start at 1, 1+4=5, 5+1=6, 6+3=9.
    # Prompt 2: at 1, then 2, then 3 (nothing accepted, one token a step).
    accepted = [[3, 0, 2, 3], [0, 0, 0]]
    drafted = [[3, 3, 3, 3], [3, 3, 2]]
    table = by_position(accepted, drafted, max_new_tokens=12, bins=3)
    assert table["bin_tokens"] == 4
    rows = table["bins"]
    assert [(r["start"], r["end"]) for r in rows] == [(0, 4), (4, 8), (8, 12)]
    assert [r["steps"] for r in rows] == [4, 2, 1]  # starts 1, 1, 2, 3 | 5, 6 | 9
    assert [r["accepted"] for r in rows] == [3, 2, 3]
    assert [r["drafted"] for r in rows] == [11, 6, 3]
    assert [r["acceptance_length"] for r in rows] == [1.75, 2.0, 4.0]
    assert rows[0]["draft_acceptance"] == pytest.approx(3 / 11)
    # The totals are the record's: nothing is cut.
    assert sum(r["steps"] for r in rows) == 7 and sum(r["accepted"] for r in rows) == 8
    # A bin no step starts in has no figure; a step past the last bin counts in it.
    sparse = by_position([[9, 9]], [[9, 9]], max_new_tokens=40, bins=4)["bins"]
    assert [r["steps"] for r in sparse] == [1, 1, 0, 0]
    assert sparse[2]["acceptance_length"] is None and sparse[2]["draft_acceptance"] is None
    late = by_position([[9, 9, 9]], [[9, 9, 9]], max_new_tokens=20, bins=2)["bins"]
    assert [r["steps"] for r in late] == [1, 2]


def answer(steps: list[list[int]], tokens: list[list[int]], wall_s: float) -> dict:
    """An engine answer as vllm_engine/decode.py gives it, its counters from the record."""
    accepted = sum(sum(s) for s in steps)
    return {
        "tokens": tokens,
        "wall_s": wall_s,
        "spec": {"drafts": sum(len(s) for s in steps), "accepted_tokens": accepted,
                 "draft_tokens": 3 * sum(len(s) for s in steps),
                 "accepted_per_position": [accepted, 0, 0]},
        "rounds_per_prompt": [len(s) for s in steps],
        "per_step_accepted": steps,
        "per_step_drafted": [[3] * len(s) for s in steps],
    }  # fmt: skip


def test_greedy_figures_stay_what_they_were_and_sampled_ones_say_their_temperature():
    tokens = [[1] * 16, [2] * 12, [3] * 8, [4] * 3]
    greedy = answer(STEPS, tokens, wall_s=1.0)
    sampled = answer([[1, 0, 2, 1], [0, 1, 0, 0, 1], [0] * 6, [1]], tokens, wall_s=1.5)
    greedy["sampled"] = {"0.7": sampled}
    plain = {"tokens": tokens, "wall_s": 2.0}
    figures = figures_at_temperatures(greedy, plain, 3, 16, Sampling(0.7, seed=11))
    assert set(figures) == {"0", "0.7"}
    at_zero, at_07 = figures["0"], figures["0.7"]
    before = acceptance({k: v for k, v in greedy.items() if k != "sampled"}, plain, 3)
    assert {key: at_zero[key] for key in before} == before  # every figure of before, as it was
    assert (at_zero["temperature"], at_zero["set"]) == (0.0, "heldout")
    assert at_zero["identical_to_plain"] is True and at_zero["speedup"] == 2.0
    assert at_zero["spread"] == prompt_spread(STEPS, seed=11)
    assert at_zero["by_position"]["bins"][0]["start"] == 0
    assert (at_07["temperature"], at_07["set"], at_07["seed"]) == (0.7, "heldout", 11)
    assert at_07["acceptance_length"] == pytest.approx(1 + 7 / 16)
    # A sampled output equals no plain one; without the plain engine's own sampled decoding
    # there is no speedup to give.
    assert at_07["identical_to_plain"] is None and at_07["speedup"] is None
    assert at_07["vs_greedy"]["difference"] == pytest.approx((7 - 20) / 16)
    plain["sampled"] = {"0.7": {"tokens": tokens, "wall_s": 3.0}}
    timed = figures_at_temperatures(greedy, plain, 3, 16, Sampling(0.7, seed=11))["0.7"]
    assert timed["speedup"] == 2.0 and timed["identical_to_plain"] is None
    # No per-request record (plain decoding): no spread, nothing else changes.
    assert record_figures({"tokens": tokens}, 16, seed=11) == {}
    # The log says each in one short line; metrics.json holds the record.
    assert in_brief(at_zero) == (
        "acceptance length 2.250, 16 rounds, 39 tokens over 4 prompts, equal to plain"
    )
    assert in_brief(at_07).endswith("39 tokens over 4 prompts")


def test_the_engine_process_samples_each_prompt_with_its_own_seed():
    request = {"max_new_tokens": 64, "seed": 1000}
    assert sampling_arguments(request, 0.0, prompts=3) == [{"max_tokens": 64, "temperature": 0.0}]
    sampled = sampling_arguments(request, 0.7, prompts=3)
    assert [each["seed"] for each in sampled] == [1000, 1001, 1002]
    assert {each["temperature"] for each in sampled} == {0.7}
    assert Sampling(0.7).key() == "0.7" and Sampling(1.0).key() == "1"
