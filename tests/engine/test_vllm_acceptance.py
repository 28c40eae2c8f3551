"""Acceptance measured by a real vLLM (the CPU build, .venv-vllm) against our own live loop:
`finished_run`'s drafter decoded by vLLM with EAGLE-3 for each K, beside the conftest's
`plain_decoding` of the same prompts (one request at a time, eager)."""

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
    from eaglenest.settings.evaluate import EvaluateSettings
    from eaglenest.stages.evaluate.evaluate import evaluate_drafter
    from eaglenest.stages.evaluate.live import emitted_per_round
    from eaglenest.stages.evaluate.vllm_evaluate import evaluate_in_vllm, live_vs_engine

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
    metrics = evaluate_drafter(
        drafter_dir=results / "drafter",
        heldout_hidden=[results / "hidden" / "00001.safetensors"],
        heldout_tokens=[results / "tokens" / "00001.parquet"],
        target_head=results / "hidden" / "target_head.safetensors",
        draft_vocab=results / "vocab" / "draft_vocab.safetensors",
        out=tmp_path / "metrics.json",
        settings=settings,
        runtime=None,
    )
    engine = evaluate_in_vllm(
        **arguments, drafter_dir=results / "drafter", ks=settings.ks,
        plain=plain_decoding["plain"],
    )  # fmt: skip
    for engine_k in engine["per_k"].values():
        engine_k["emitted_per_round"] = emitted_per_round(
            engine_k["tokens"], engine_k["prompts"], engine_k["rounds"]
        )
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
        assert abs(metrics["live_vs_engine"][k] - 1) <= 0.03, metrics["live_vs_engine"]
