"""The EAGLE-3 variants in a real vLLM (the CPU build, .venv-vllm): a drafter trained with each
of norm_before_fc, fc_norm, norm_before_residual and norm_output, loaded by vLLM from its
config.json, decodes what plain greedy decoding does (the conftest's `plain_decoding`), with the
acceptance our live evaluator measures. One engine start per variant, eager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.workflow import SMALL_RUN

from eaglenest.settings.train import DRAFTER_VARIANTS


@pytest.mark.parametrize("option", DRAFTER_VARIANTS)
def test_each_eagle3_variant_decodes_in_vllm_as_in_our_live_evaluator(
    option: str, finished_run: Path, plain_decoding: dict, tmp_path: Path
):
    """A drafter trained with the option on, exported, loaded by vLLM (which reads the option
    from config.json): vLLM's EAGLE-3 output equals its plain greedy output, our live loop's
    equals the transformers target's greedy output, the tokens are the same, and the two
    acceptance lengths agree within 3%."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.settings.evaluate import EvaluateSettings
    from eaglenest.settings.train import TrainSettings
    from eaglenest.stages.evaluate.evaluate import evaluate_drafter
    from eaglenest.stages.evaluate.vllm_evaluate import evaluate_in_vllm
    from eaglenest.stages.train.train import train_drafter

    results = finished_run / "results" / SMALL_RUN
    shared = {
        "target_head": results / "hidden" / "target_head.safetensors",
        "draft_vocab": results / "vocab" / "draft_vocab.safetensors",
    }
    target = {"path": str(results / "target")}
    train = {
        "epochs": 12,
        "lr": 3e-3,
        "warmup_steps": 5,
        "max_batch_tokens": 1024,
        "ttt_steps": 3,
        "export_dtype": "float32",
        "drafter": {name: name == option for name in DRAFTER_VARIANTS},
    }
    report = train_drafter(
        train_shards=[results / "hidden" / "00000.safetensors"],
        eval_shards=[],
        out_dir=tmp_path / "drafter",
        journal_dir=tmp_path / "journal",
        settings=settings_from_sections(TrainSettings, train=train, target=target),
        **shared,
    )
    assert report["drafter"][option] is True
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config[option] is True
    evaluate = {"ks": [3], "device": "cpu", "live_prompts": 8, "live_max_new_tokens": 64}
    metrics = evaluate_drafter(
        drafter_dir=tmp_path / "drafter",
        heldout_hidden=[results / "hidden" / "00001.safetensors"],
        heldout_tokens=[results / "tokens" / "00001.parquet"],
        out=tmp_path / "metrics.json",
        settings=settings_from_sections(EvaluateSettings, evaluate=evaluate, target=target),
        runtime=None,
        **shared,
    )
    engine = evaluate_in_vllm(
        **plain_decoding["arguments"], drafter_dir=tmp_path / "drafter", ks=(3,),
        plain=plain_decoding["plain"],
    )  # fmt: skip
    vllm, live = engine["per_k"]["3"], metrics["live"]["3"]
    print(f"{option}: vLLM {vllm['acceptance_length']:.4f} ({vllm['rounds']} rounds), live "
          f"{live['acceptance_length']:.4f} ({live['rounds']} rounds)")  # fmt: skip
    assert vllm["identical_to_plain"] and live["identical_to_greedy"]
    assert vllm["tokens"] == live["tokens"]
    assert live["acceptance_length"] > 1.3  # trained enough that a wrong variant would show
    # Unbatched, the rounds were equal for every variant here (vLLM may count one more a prompt).
    assert abs(vllm["rounds"] - live["rounds"]) <= vllm["prompts"]
    assert abs(live["acceptance_length"] / vllm["acceptance_length"] - 1) <= 0.03
