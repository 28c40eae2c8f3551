"""The engine evaluation's configurations (plainly, each K) go to one engine process, which starts
them one after another (vllm_evaluate.decode_each): what the process is asked, the answers it gives
back in order, and an error that says how far it got when it ends early. The process here is a
real one standing in for vLLM's interpreter (a script that reads the requests file and answers
as vllm_engine/decode.py does); the real engine: tests/engine/ (every vLLM evaluation)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from eaglenest.common.config import settings_from_sections
from eaglenest.settings.vllm import VllmEngine, VllmRuntime
from eaglenest.stages.evaluate.vllm_evaluate import decode_each, engine_request
from eaglenest.vllm_engine.process import EngineError

# Called as `python -m eaglenest.vllm_engine.decode <requests.json>`: answers the first
# ANSWERED requests, then exits with 3.
FAKE_ENGINE = """#!/bin/sh
exec {python} -c '
import json, sys
requests = json.load(open(sys.argv[-1]))
for request in requests[:{answered}]:
    print("EAGLENEST " + json.dumps({{"engine_ready_s": 0.1, "k": request["k"]}}))
    print("some engine log line")
    print("EAGLENEST " + json.dumps({{"done": True, "k": request["k"],
        "max_model_len": request["max_model_len"], "tokens": [[1, 2]], "wall_s": 0.1,
        "spec": {{}}, "groups": {{}}}}))
sys.exit(3)
' "$@"
"""


def fake_engine(tmp_path: Path, answered: int) -> VllmRuntime:
    script = tmp_path / "python"
    script.write_text(FAKE_ENGINE.format(python=sys.executable, answered=answered))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return settings_from_sections(VllmRuntime, vllm={"python": str(script)})


def requests(runtime: VllmRuntime, ks: list[int | None]) -> list[dict]:
    request = engine_request(
        prompts=[[1] * 30], drafter_dir="drafter", target_path="target", max_new_tokens=64,
        model_dtype="float32", engine=settings_from_sections(VllmEngine), runtime=runtime,
    )  # fmt: skip
    return [{**request, "k": k} for k in ks]


def test_every_configuration_is_answered_in_order_by_one_process(tmp_path):
    runtime = fake_engine(tmp_path, answered=3)
    answers = decode_each(requests(runtime, [None, 3, 7]), runtime, tmp_path)
    assert [answer["k"] for answer in answers] == [None, 3, 7]
    # Each configuration keeps its own draft room (vllm_evaluate.with_draft_room).
    assert [answer["max_model_len"] for answer in answers] == [94, 94 + 6, 94 + 14]
    asked = json.loads((tmp_path / "plain+k3+k7.json").read_text())
    assert [request["k"] for request in asked] == [None, 3, 7]


def test_a_process_that_ends_early_says_how_far_it_got(tmp_path):
    runtime = fake_engine(tmp_path, answered=1)
    with pytest.raises(EngineError) as error:
        decode_each(requests(runtime, [None, 3, 7]), runtime, tmp_path)
    message = str(error.value)
    assert "vLLM decoding (plain+k3+k7) ended (exit code 3) after 1 of 3 configurations" in message
    assert "some engine log line" in message
