"""The EAGLE-3 variants in a real vLLM (the CPU build, .venv-vllm): a drafter trained with each
of norm_before_fc, fc_norm, norm_before_residual and norm_output, loaded by vLLM from its
config.json, decodes what plain greedy decoding does (the conftest's `plain_decoding`), with the
acceptance our live evaluator measures. The four drafters are decoded by one vLLM process (an
engine each, one after another, eager): one import of vLLM for all of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.drafters import evaluate_on_heldout, run_files
from support.workflow import SMALL_RUN

from eaglenest.settings.families import DRAFTER_VARIANTS


def train_and_decode_live(option: str, results: Path, out: Path) -> dict:
    """A drafter trained with `option` on (the rest off), exported to out/drafter, and our live
    evaluator's figures for it at K=3."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.settings.train import TrainSettings
    from eaglenest.stages.train.train import train_drafter

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
        out_dir=out / "drafter",
        journal_dir=out / "journal",
        settings=settings_from_sections(TrainSettings, train=train, target=target),
        **run_files(results),
    )
    metrics = evaluate_on_heldout(
        out / "drafter", results, out / "metrics.json", ks=[3], prompts=8, max_new_tokens=64
    )
    return {"report": report, "live": metrics["live"]["3"]}


@pytest.fixture(scope="module")
def variants(
    finished_run: Path, plain_decoding: dict, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """Each variant's drafter, our live figures, and vLLM's figures at K=3: the four drafters
    decoded by one vLLM process, an engine each."""
    from eaglenest.stages.evaluate.vllm_evaluate import acceptance, decode_each, engine_request

    results = finished_run / "results" / SMALL_RUN
    work = tmp_path_factory.mktemp("variants")
    found = {
        option: {
            "dir": work / option,
            **train_and_decode_live(option, results, work / option),
        }
        for option in DRAFTER_VARIANTS
    }
    arguments = plain_decoding["arguments"]
    requests = [
        {**engine_request(**arguments, drafter_dir=found[option]["dir"] / "drafter"), "k": 3}
        for option in DRAFTER_VARIANTS
    ]
    answers = decode_each(requests, arguments["runtime"], work)
    for option, answer in zip(DRAFTER_VARIANTS, answers, strict=True):
        found[option]["vllm"] = acceptance(answer, plain_decoding["plain"], 3)
    return found


@pytest.mark.parametrize("option", DRAFTER_VARIANTS)
def test_each_eagle3_variant_decodes_in_vllm_as_in_our_live_evaluator(option: str, variants):
    """A drafter trained with the option on, exported, loaded by vLLM (which reads the option
    from config.json): vLLM's EAGLE-3 output equals its plain greedy output, our live loop's
    equals the transformers target's greedy output, the tokens are the same, and the two
    acceptance lengths agree within 3%."""
    found = variants[option]
    assert found["report"]["drafter"][option] is True
    config = json.loads((found["dir"] / "drafter" / "config.json").read_text())
    assert config[option] is True
    vllm, live = found["vllm"], found["live"]
    print(f"{option}: vLLM {vllm['acceptance_length']:.4f} ({vllm['rounds']} rounds), live "
          f"{live['acceptance_length']:.4f} ({live['rounds']} rounds)")  # fmt: skip
    assert vllm["identical_to_plain"] and live["identical_to_greedy"]
    assert vllm["tokens"] == live["tokens"]
    assert live["acceptance_length"] > 1.3  # trained enough that a wrong variant would show
    assert abs(vllm["rounds"] - live["rounds"]) <= vllm["prompts"]
    assert abs(live["acceptance_length"] / vllm["acceptance_length"] - 1) <= 0.03
