"""Acceptance by depth measured the same way in our live decoding and in a real vLLM (the CPU
build in .venv-vllm): the small demo run's held-out samples cut at each depth (prompts sent as
token ids), the continuation decoded with the run's drafter; per depth and K, vLLM needs the
rounds our live loop needs (within one a prompt), both outputs equal to plain greedy decoding,
and the simulated acceptance per depth is there too."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.vllm import VLLM_PYTHON, require_vllm_venv
from support.workflow import SMALL_DEMO, SMALL_RUN

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The small demo's samples hold 60-130 tokens: depth 48 cuts inside most answers.
DEPTHS = [0, 48]
CONTINUATION = 16


def test_own_live_and_vllm_need_the_same_rounds_at_every_depth(finished_run: Path, tmp_path):
    from eaglenest.common.config import settings_from_sections
    from eaglenest.settings.evaluate import EvaluateSettings
    from eaglenest.settings.vllm import VllmRuntime
    from eaglenest.stages.evaluate.evaluate import evaluate_drafter

    require_vllm_venv()
    results = finished_run / "results" / SMALL_RUN
    evaluate = {**SMALL_DEMO["evaluate"], "engine": "vllm", "device": "cpu", "live_prompts": 4,
                "live_max_new_tokens": CONTINUATION, "depths": DEPTHS}  # fmt: skip
    settings = settings_from_sections(
        EvaluateSettings, evaluate=evaluate, target={"path": str(results / "target")}
    )
    metrics = evaluate_drafter(
        drafter_dir=results / "drafter",
        heldout_hidden=[results / "hidden" / "00001.safetensors"],
        heldout_tokens=[results / "tokens" / "00001.parquet"],
        target_head=results / "hidden" / "target_head.safetensors",
        draft_vocab=results / "vocab" / "draft_vocab.safetensors",
        out=tmp_path / "metrics.json",
        settings=settings,
        runtime=settings_from_sections(VllmRuntime, vllm={"python": VLLM_PYTHON}),
    )
    table = metrics["by_depth"]
    assert table["depths"] == DEPTHS and table["continuation_tokens"] == CONTINUATION
    assert set(table["per_k"]) == {str(k) for k in settings.ks}
    for k, rows in table["per_k"].items():
        assert [row["depth"] for row in rows] == DEPTHS
        for row in rows:
            live, engine, simulated = row["live"], row["engine"], row["simulated"]
            print(f"K={k} depth {row['depth']}: {row['prompts']} prompts, live "
                  f"{live['acceptance_length']:.3f} ({live['rounds']} rounds), vLLM "
                  f"{engine['acceptance_length']:.3f} ({engine['rounds']} rounds), simulated "
                  f"{simulated['acceptance_length']:.3f}")  # fmt: skip
            assert row["prompts"] == 4 == live["prompts"] == engine["prompts"]
            assert live["identical_to_greedy"] and engine["identical_to_plain"]
            assert live["tokens"] == engine["tokens"]
            assert abs(live["rounds"] - engine["rounds"]) <= row["prompts"]
            assert simulated["positions"] > 0
    # The deeper cut decodes other tokens than the prompt's: the two depths measure different
    # stretches of the answers.
    assert (
        table["per_k"]["2"][1]["simulated"]["positions"]
        < table["per_k"]["2"][0]["simulated"]["positions"]
    )
