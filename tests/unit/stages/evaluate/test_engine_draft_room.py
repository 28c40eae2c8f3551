"""The room an evaluation engine leaves for its drafts (vllm_evaluate.with_draft_room): vLLM 0.32
stops drafting once a step's sequence plus K no longer fits in max_model_len, so an engine sized
to prompt + new tokens decoded the longest answers' last ~2K tokens without drafts, one a round,
and counted those rounds (tests/engine/test_windowed_drafter.py: 247 rounds against 233 at K=7)."""

from __future__ import annotations

import logging

from eaglenest.common.config import settings_from_sections
from eaglenest.settings.vllm import VllmEngine, VllmRuntime
from eaglenest.stages.evaluate.vllm_evaluate import engine_request, with_draft_room


def _request(max_model_len: int | None) -> tuple[dict, VllmRuntime]:
    runtime = settings_from_sections(VllmRuntime, vllm={"max_model_len": max_model_len})
    request = engine_request(
        prompts=[[1] * 30, [1] * 34], drafter_dir="drafter", target_path="target",
        max_new_tokens=64, model_dtype="float32", engine=settings_from_sections(VllmEngine),
        runtime=runtime, groups={"128": [[1] * 40]},
    )  # fmt: skip
    return request, runtime


def test_a_derived_max_model_len_leaves_two_k_positions_for_the_drafts():
    request, runtime = _request(None)
    assert request["max_model_len"] == 40 + 64  # the longest prompt, a depth cut's included
    assert with_draft_room({**request, "k": None}, runtime)["max_model_len"] == 104
    assert with_draft_room({**request, "k": 3}, runtime)["max_model_len"] == 104 + 6
    assert with_draft_room({**request, "k": 7}, runtime)["max_model_len"] == 104 + 14


def test_the_users_max_model_len_stays_and_a_short_one_is_named(caplog):
    request, runtime = _request(110)
    with caplog.at_level(logging.WARNING):
        assert with_draft_room({**request, "k": 3}, runtime)["max_model_len"] == 110
        assert not caplog.records
        assert with_draft_room({**request, "k": 7}, runtime)["max_model_len"] == 110
    assert "vllm.max_model_len 110 is below the 118 that K=7 needs" in caplog.text
