"""Acceptance measured by a real vLLM (the CPU build, .venv-vllm) against our own live loop:
`finished_run`'s drafter decoded by vLLM with EAGLE-3 for each K, beside the conftest's
`plain_decoding` of the same prompts (one request at a time, eager); the same engines also
decode them sampled (vLLM's rejection sampling, seeded), in the other thinking mode (off: the
fixture's group), and half of them once more; the standard sets (evaluate.sets) by the same
engines, and the drafter compared with a copy of itself (evaluate.compare) at K=3."""

from __future__ import annotations

from pathlib import Path

from support.workflow import SMALL_DEMO, SMALL_RUN


def test_vllm_measures_the_acceptance_our_live_evaluator_measures(
    finished_run: Path, plain_decoding: dict, tmp_path: Path
):
    """The run's drafter decoded by vLLM (EAGLE-3 for each K, and plainly): the speculative
    outputs equal the plain ones, vLLM needs the rounds our live loop needs for the same tokens,
    and the acceptance lengths agree within 3%. The evaluate stage's own figures, assembled as
    it assembles them (evaluate_drafter with `evaluate.engine: vllm` runs whole, plain decoding
    included, in tests/engine/test_deepseek_v3_in_vllm.py); the plain decoding is the one every
    drafter of the small demo is compared with."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.formats.metrics import emitted_per_round
    from eaglenest.settings.evaluate import EvaluateSettings
    from eaglenest.stages.evaluate.evaluate import evaluate_drafter
    from eaglenest.stages.evaluate.thinking import ThinkingEvaluation, thinking_section
    from eaglenest.stages.evaluate.vllm_evaluate import Sampling, evaluate_in_vllm, live_vs_engine

    results = finished_run / "results" / SMALL_RUN
    evaluate = {**SMALL_DEMO["evaluate"], "device": "cpu", "live_prompts": 8,
                "live_max_new_tokens": 64}  # fmt: skip
    target = {"path": str(results / "target")}
    settings = settings_from_sections(EvaluateSettings, evaluate=evaluate, target=target)
    arguments = plain_decoding["arguments"]
    assert (settings.live_prompts, settings.live_max_new_tokens) == (
        len(arguments["prompts"]),
        arguments["max_new_tokens"],
    )
    # Our live loop in both modes too: the drafter was trained on shard 00000, thinking on.
    other = plain_decoding["thinking"]["other"]
    train_tokens = [results / "tokens" / "00000.parquet"]
    metrics = evaluate_drafter(
        drafter_dir=results / "drafter",
        heldout_hidden=[results / "hidden" / "00001.safetensors"],
        heldout_tokens=[results / "tokens" / "00001.parquet"],
        target_head=results / "hidden" / "target_head.safetensors",
        draft_vocab=results / "vocab" / "draft_vocab.safetensors",
        out=tmp_path / "metrics.json",
        settings=settings,
        runtime=None,
        thinking=ThinkingEvaluation(plain_decoding["thinking"]["settings"], train_tokens),
    )
    # The first half of the prompts again, as a group of the same engines: greedy and sampled
    # with the same seeds (each prompt's is the seed + its index), one request at a time.
    half = len(arguments["prompts"]) // 2
    plain = plain_decoding["plain"]
    again = {**plain, "tokens": plain["tokens"][:half]}
    plain = {**plain, "groups": {**plain["groups"], "again": again}}
    # The other thinking mode's group after them, as the evaluate stage files it after the
    # depths: the figures before it are those of a decoding without it. (Decoded before the
    # half again, it changed prompt 0's rounds there, 47 against 35, the tokens the same: the
    # engine keeps prefix blocks cached between prompts, and the off prompts extend the on ones.)
    # The standard sets too (the fixture's plain engine answered them turn by turn).
    same = {"plain": plain, "sampling": Sampling(0.7, seed=5), "sets": plain_decoding["sets"],
            "depth_prompts": {"again": arguments["prompts"][:half], **other.groups()}}  # fmt: skip
    engine = evaluate_in_vllm(**arguments, drafter_dir=results / "drafter", ks=settings.ks, **same)
    assert_standard_sets(engine["sets"], plain["sets"], settings.ks)
    assert_a_compared_copy_matches(results / "drafter", tmp_path, arguments, same, engine)
    for per_k in (engine["per_k"], engine["by_depth"][other.group]):
        for engine_k in per_k.values():
            engine_k["emitted_per_round"] = emitted_per_round(
                engine_k["tokens"], engine_k["prompts"], engine_k["rounds"]
            )
    off = {k: dict(figures) for k, figures in engine["by_depth"][other.group].items()}
    decoded = {"live": metrics["live"], "engine": engine}
    modes = thinking_section(other, decoded, train_tokens).to_json()
    assert_both_modes(metrics["thinking"], modes, engine, off, len(arguments["prompts"]))
    metrics["live_vs_engine"] = live_vs_engine(metrics["live"], engine["per_k"])
    assert engine["engine"] == "vllm" and set(engine["per_k"]) == {str(k) for k in settings.ks}
    for k, vllm in engine["per_k"].items():
        live = metrics["live"][k]
        print(f"K={k}: vLLM {vllm['acceptance_length']:.4f} ({vllm['rounds']} rounds), live "
              f"{live['acceptance_length']:.4f} ({live['rounds']} rounds)")  # fmt: skip
        assert vllm["identical_to_plain"] and live["identical_to_greedy"]
        assert vllm["tokens"] == live["tokens"] == engine["plain"]["tokens"]
        # The same rounds but at the end of an answer, where vLLM may verify once more than
        # our loop (drafts it counts past max_new_tokens); on the demo of make run they match.
        assert abs(vllm["rounds"] - live["rounds"]) <= vllm["prompts"]
        assert len(vllm["per_position_acceptance"]) == int(k)
        # Per prompt, what the report's choice bootstraps over: emitted tokens and rounds.
        assert len(vllm["emitted_per_prompt"]) == len(vllm["rounds_per_prompt"]) == vllm["prompts"]
        assert sum(vllm["emitted_per_prompt"]) == vllm["tokens"] - vllm["prompts"]
        assert abs(metrics["live_vs_engine"][k] - 1) <= 0.03, metrics["live_vs_engine"]
        sampled, again = engine["sampled"]["per_k"][k], engine["by_depth"]["again"][k]
        sampled_again = engine["sampled"]["by_depth"]["again"][k]
        print(f"K={k} at T=0.7: vLLM {sampled['acceptance_length']:.4f} "
              f"({sampled['rounds']} rounds), {sampled['vs_greedy']}")  # fmt: skip
        assert (vllm["temperature"], sampled["temperature"], sampled["set"]) == (0, 0.7, "heldout")
        # Greedy again: the same rounds prompt for prompt. Sampled: other answers than greedy,
        # the same again with the same seeds.
        assert again["identical_to_plain"]
        assert again["rounds_per_prompt"] == vllm["rounds_per_prompt"][:half]
        assert sampled["rounds_per_prompt"] != vllm["rounds_per_prompt"]
        assert sampled_again["rounds_per_prompt"] == sampled["rounds_per_prompt"][:half]
        assert sampled_again["spread"]["per_prompt"] == sampled["spread"]["per_prompt"][:half]
        for figures in (vllm, sampled):
            # The per-request record sums to vLLM's own counters: every step binned, none cut.
            bins = figures["by_position"]["bins"]
            assert sum(b["steps"] for b in bins) == figures["rounds"]
            assert sum(b["accepted"] for b in bins) == figures["accepted_tokens"]
            assert abs(figures["spread"]["acceptance_length"] - figures["acceptance_length"]) < 1e-9
            low, high = figures["spread"]["ci95"]
            assert low <= figures["acceptance_length"] <= high


def assert_both_modes(live: dict, modes: dict, engine: dict, off: dict, prompts: int) -> None:
    """metrics.json `thinking` of the live loop (`live`) and with vLLM's figures (`modes`): the
    drafter trained thinking on, every held-out prompt decoded off too, in both ways; vLLM's
    answers in the other mode equal the plain engine's and emit the tokens our loop emits; the
    generated mode's figures are the held-out prompts' own, the other mode's filed apart."""
    assert live["trained"] == {"mode": "on", "samples": live["trained"]["samples"]}
    assert (live["heldout_mode"], live["other_mode"], live["switch"]) == (
        "on", "off", "enable_thinking"
    )  # fmt: skip
    assert (live["other_prompts"], live["not_flipped"]) == (prompts, 0)
    assert set(engine["by_depth"]) == {"again"} and set(engine["sampled"]["by_depth"]) == {"again"}
    for k, vllm in engine["per_k"].items():
        on = modes["modes"]["on"]["engine"][k]
        assert on == {key: vllm[key] for key in on} and on["prompts"] == prompts
        ours = live["modes"]["off"]["live"][k]
        print(f"K={k} thinking off: vLLM {off[k]['acceptance_length']:.4f} ({off[k]['rounds']} "
              f"rounds), live {ours['acceptance_length']:.4f}; thinking on: vLLM "
              f"{vllm['acceptance_length']:.4f}")  # fmt: skip
        assert off[k]["identical_to_plain"] and off[k]["prompts"] == ours["prompts"] == prompts
        assert off[k]["tokens"] == ours["tokens"]
        other_mode = modes["modes"]["off"]
        assert other_mode["engine"][k]["acceptance_length"] == off[k]["acceptance_length"]
        assert other_mode["sampled"][k]["prompts"] == prompts
        ratio = modes["other_vs_generated"]["engine"][k]
        assert ratio == off[k]["acceptance_length"] / vllm["acceptance_length"]


def assert_standard_sets(sets: dict, plain: dict, ks: tuple[int, ...]) -> None:
    """metrics.json `sets` of the demo's MT-Bench questions (two with a second turn, answered
    after the target's own first answer) and a GSM8K-style set: per set and category, every K's
    answers equal the plain engine's on the recorded prompts, and each figure names its set,
    category and temperature."""
    assert set(sets) == {"mt_bench", "gsm8k"}
    mt_bench = plain["mt_bench"]
    two = [i for i, turns in enumerate(mt_bench["prompts"]) if len(turns) == 2]
    assert len(two) == 2 and sets["mt_bench"]["turns"] == len(mt_bench["prompts"]) + 2
    for i in two:
        first, second = mt_bench["prompts"][i]
        # The second turn's context: the first prompt, then the target's answer, then turn 2.
        assert second[: len(first)] == first and len(second) > len(first) + 4
    for name, figures in sets.items():
        assert figures["temperature"] == 0.0 and figures["set"] == name
        for k in ks:
            whole = figures["engine"]["per_k"][str(k)]
            print(f"{name} K={k}: vLLM {whole['acceptance_length']:.4f} "
                  f"({whole['rounds']} rounds, {whole['prompts']} turns)")  # fmt: skip
            assert (whole["set"], whole["category"], whole["temperature"]) == (name, None, 0.0)
            assert whole["identical_to_plain"] and whole["prompts"] == figures["turns"]
            assert whole["acceptance_length"] >= 1.0 and whole["emitted_per_round"] >= 1.0
            for category in figures["categories"]:
                per_k = figures["engine"]["by_category"][category][str(k)]
                assert per_k["category"] == category and per_k["identical_to_plain"]
            # Sampled on the same recorded contexts (the engines' sampled temperature, 0.7).
            sampled = figures["sampled"]["0.7"]["per_k"][str(k)]
            assert (sampled["set"], sampled["temperature"]) == (name, 0.7)
            assert sampled["prompts"] == figures["turns"] and sampled["identical_to_plain"] is None
            assert set(figures["sampled"]["0.7"]["by_category"]) == set(figures["categories"])


def assert_a_compared_copy_matches(
    drafter: Path, tmp_path: Path, arguments: dict, same: dict, engine: dict
) -> None:
    """A copy of the run's drafter through evaluate.compare (its method read from its
    config.json), decoded at K=3 on the same prompts, groups, sets and sampling: the figures the
    run's drafter got, every count equal."""
    import shutil

    from eaglenest.settings.compared_drafters import compared_drafter
    from eaglenest.stages.evaluate.vllm_evaluate import evaluate_in_vllm

    copy = shutil.copytree(drafter, tmp_path / "published")
    compared = compared_drafter(copy)
    theirs = evaluate_in_vllm(
        **arguments, drafter_dir=copy, ks=(3,), **same,
        speculative_config=compared.speculative_config,
    )  # fmt: skip
    counts = ("acceptance_length", "rounds", "accepted_per_position", "tokens", "rounds_per_prompt")

    def counted(figures: dict) -> dict:
        return {key: figures.get(key) for key in counts}

    assert compared.method == {"method": "eagle3"}
    assert counted(theirs["per_k"]["3"]) == counted(engine["per_k"]["3"])
    for name, figures in engine["sets"].items():
        ours, copied = figures["engine"], theirs["sets"][name]["engine"]
        assert counted(copied["per_k"]["3"]) == counted(ours["per_k"]["3"])
        for category, per_k in ours["by_category"].items():
            assert counted(copied["by_category"][category]["3"]) == counted(per_k["3"])
