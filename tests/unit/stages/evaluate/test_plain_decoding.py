"""The run's one plain decoding in vLLM (stages/evaluate/plain.py, the rule decode_plain): the
plain job and every evaluation (each family's evaluate_drafter, each evaluate_compare) build the
same plain request from one function: the held-out prompts, their depth cuts, the other thinking
mode's prompts and the standard sets, sized for the sets' turns, with no drafter and no draft
room; evaluate.ks is no part of it. An evaluation refuses a plain decoding that answered another
request, naming the file and what differs. The engines decode it in tests/engine/ and
tests/workflow/ (the workflow with evaluate.engine vllm: tests/engine/test_long_reasoning_demo.py)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import polars as pl
import pytest
from support.eval_sets import demo_engine_sets
from support.tiny_tokenizer import make_tokenizer

import eaglenest.demo
from eaglenest.common.config import validate_config
from eaglenest.settings.evaluate import (
    CompareSettings,
    EvaluateSettings,
    PlainSettings,
    evaluate_job_settings_json,
)
from eaglenest.settings.thinking import ThinkingSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.evaluate.plain import engine_inputs, read_plain, run_plain_request
from eaglenest.stages.evaluate.thinking import ThinkingEvaluation
from eaglenest.stages.evaluate.vllm_evaluate import (
    acceptance,
    engine_arguments,
    request_of,
    sized_request,
    with_draft_room,
)
from eaglenest.target_model.tokenizer import open_tokenizer

DEMO = Path(eaglenest.demo.__file__).parent
MAX_NEW_TOKENS = 16
QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Count to three."]


def run_config(target_dir: Path, **evaluate) -> dict:
    sections = {
        "target": {"path": str(target_dir), "chat_template_kwargs": {"enable_thinking": True}},
        "evaluate": {
            "engine": "vllm",
            "ks": [3, 7],
            "depths": [0, 32],
            "live_prompts": 2,
            "live_max_new_tokens": MAX_NEW_TOKENS,
            **evaluate,
        },
        "generation": {"temperature": 0.7},
        # DFlash in blocks of 4: its job measures K 3 only, EAGLE-3 3 and 7
        "train": {"families": ["eagle3", "dflash"], "dflash": {"block_size": 4}},
    }
    return validate_config(sections)


@pytest.fixture(scope="module")
def demo_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's tokenizer and chat template (the demo's Qwen3 one, its thinking switch): all
    the requests read of the target besides its path."""
    template = (DEMO / "chat_template.jinja").read_text()
    return make_tokenizer(tmp_path_factory.mktemp("target"), chat_template=template)


@pytest.fixture(scope="module")
def heldout_tokens(demo_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A held-out tokens shard: the questions rendered as generation renders them (thinking on),
    each followed by 80 answer tokens."""
    tokenizer = open_tokenizer(demo_target_dir, trust_remote_code=False)
    rows = []
    for question in QUESTIONS:
        chat = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False, enable_thinking=True
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append({"input_ids": prompt + list(range(100, 180)), "prompt_len": len(prompt)})
    path = tmp_path_factory.mktemp("plain") / "00001.parquet"
    pl.DataFrame(rows).write_parquet(path)
    return path


@pytest.fixture(scope="module")
def engine_sets(demo_target_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return demo_engine_sets(tmp_path_factory.mktemp("sets"), demo_target_dir, MAX_NEW_TOKENS)


def plain_request_of(settings, config: dict, tokens: Path, sets) -> dict:
    """The plain request a job of these settings builds (every job passes the run's thinking
    settings: the evaluate job its own, the plain and compare jobs theirs)."""
    thinking = ThinkingEvaluation(ThinkingSettings.from_config(config), [])
    inputs = engine_inputs([tokens], settings, thinking)
    return run_plain_request(inputs, settings, VllmRuntime.from_config(config), sets)


def test_every_job_builds_the_one_plain_request(
    demo_target_dir: Path, heldout_tokens: Path, engine_sets
):
    config = run_config(demo_target_dir)
    evaluate = EvaluateSettings.from_config(config).to_json()
    jobs = {
        "decode_plain": PlainSettings.from_config(config),
        "compare": CompareSettings.from_config(config),
        **{
            family: EvaluateSettings.from_json(evaluate_job_settings_json(evaluate, config, family))
            for family in ("eagle3", "dflash")
        },
    }
    assert (jobs["eagle3"].ks, jobs["dflash"].ks) == ((3, 7), (3,))
    requests = {
        job: plain_request_of(s, config, heldout_tokens, engine_sets) for job, s in jobs.items()
    }
    plain = requests["decode_plain"]
    assert all(request == plain for request in requests.values())
    # Plain: no drafter, k None; every group: both cuts, the other thinking mode's prompts.
    assert plain["k"] is None and "drafter" not in plain and "speculative_config" not in plain
    assert sorted(plain["groups"]) == ["0", "32", "thinking:off"]
    assert len(plain["prompts"]) == 2 and plain["max_new_tokens"] == MAX_NEW_TOKENS
    assert (plain["temperatures"], plain["seed"]) == ([0.7], config["train"]["seed"])
    assert sorted(plain["sets"]) == ["gsm8k", "mt_bench"]
    # Sized for the sets' longest turn, as the K engines' request; they get draft room, it none.
    longest = max(s.longest_prompt for s in engine_sets.sets) + MAX_NEW_TOKENS
    assert plain["max_model_len"] == longest
    settings = jobs["eagle3"]
    inputs = engine_inputs([heldout_tokens], settings, None)
    runtime = VllmRuntime.from_config(config)
    arguments = engine_arguments(settings, runtime, inputs.model_dtype, inputs.cuts)
    k_request = sized_request(
        request_of(inputs.prompts, "drafter", arguments), engine_sets, runtime
    )
    assert k_request["max_model_len"] == longest and k_request["drafter"].endswith("drafter")
    assert with_draft_room({**k_request, "k": 7}, runtime)["max_model_len"] == longest + 14
    # evaluate.ks is no param of decode_plain: changing it reruns the K engines' jobs only.
    fewer_ks = run_config(demo_target_dir, ks=[3])
    assert PlainSettings.from_config(fewer_ks).to_json() == jobs["decode_plain"].to_json()
    longer = run_config(demo_target_dir, live_max_new_tokens=MAX_NEW_TOKENS + 1)
    assert PlainSettings.from_config(longer).to_json() != jobs["decode_plain"].to_json()


def test_an_evaluation_refuses_a_plain_decoding_of_another_request(
    demo_target_dir: Path, heldout_tokens: Path, tmp_path: Path
):
    """The file holds the plain answer and its request: read back, the answer as decoded; with
    another request (a shorter continuation, other prompts) a ValueError names the file."""
    config = run_config(demo_target_dir, depths=[])
    settings = PlainSettings.from_config(config)
    runtime = VllmRuntime.from_config(config)
    request = plain_request_of(settings, config, heldout_tokens, None)
    answer = {"done": True, "k": None, "tokens": [[5, 6], [7]], "wall_s": 1.5, "groups": {}}
    path = tmp_path / "eval_plain" / "decoding.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**answer, "request": request}))
    thinking = ThinkingEvaluation(ThinkingSettings.from_config(config), [])
    inputs = engine_inputs([heldout_tokens], settings, thinking)
    assert read_plain(path, inputs, settings, runtime, None) == answer

    shorter = PlainSettings.from_config(
        run_config(demo_target_dir, depths=[], live_max_new_tokens=MAX_NEW_TOKENS - 4)
    )
    with pytest.raises(ValueError, match=r"decoding\.json.*differs in max_new_tokens\)"):
        read_plain(path, inputs, shorter, runtime, None)
    # The engine's placement (vllm.* runtime, untracked) changes no greedy token: still read
    # (untimed where it changes the speed: the next test).
    path.write_text(json.dumps({**answer, "request": {**request, "max_model_len": 4096}}))
    assert read_plain(path, inputs, settings, runtime, None) == answer
    placed = {**request, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5}
    path.write_text(json.dumps({**answer, "request": placed}))
    assert read_plain(path, inputs, settings, runtime, None)["tokens"] == answer["tokens"]
    other = {**request, "prompts": request["prompts"][:1]}
    path.write_text(json.dumps({**answer, "request": other}))
    with pytest.raises(ValueError, match=rf"{path}: .* differs in prompts"):
        read_plain(path, inputs, settings, runtime, None)


def test_a_plain_decoding_timed_apart_gives_no_speedup(
    demo_target_dir: Path, heldout_tokens: Path, tmp_path: Path
):
    """decode_plain on another node (a cluster) or at another tensor-parallel size than the
    evaluation's K engines: its tokens still check the K engines' outputs, but a speed-up from
    two machines' clocks is no figure: every wall time of the file is dropped, metrics.json's
    speedup is null and `engine.plain.untimed` says why. The same host and placement: timed."""
    config = run_config(demo_target_dir, depths=[])
    settings = PlainSettings.from_config(config)
    runtime = VllmRuntime.from_config(config)
    request = plain_request_of(settings, config, heldout_tokens, None)
    thinking = ThinkingEvaluation(ThinkingSettings.from_config(config), [])
    inputs = engine_inputs([heldout_tokens], settings, thinking)
    answer = {"tokens": [[5, 6], [7]], "wall_s": 1.5, "groups": {"0": {"wall_s": 0.5}}}
    path = tmp_path / "decoding.json"
    spec = {"tokens": [[5, 6], [7]], "wall_s": 0.5, "spec": {"drafts": 2, "accepted_tokens": 1}}

    path.write_text(json.dumps({**answer, "host": socket.gethostname(), "request": request}))
    here = read_plain(path, inputs, settings, runtime, None)
    assert here == answer and acceptance(spec, here, 3)["speedup"] == pytest.approx(3.0)

    path.write_text(json.dumps({**answer, "host": "node-17", "request": request}))
    apart = read_plain(path, inputs, settings, runtime, None)
    assert apart["tokens"] == answer["tokens"] and apart["groups"]["0"]["wall_s"] is None
    assert "host node-17" in apart["untimed"] and str(path) in apart["untimed"]
    figures = acceptance(spec, apart, 3)
    assert figures["identical_to_plain"] and figures["acceptance_length"] == 1.5
    assert figures["speedup"] is None and figures["plain_wall_s"] is None

    wider = {**request, "tensor_parallel_size": 8}
    path.write_text(json.dumps({**answer, "host": socket.gethostname(), "request": wider}))
    placed = read_plain(path, inputs, settings, runtime, None)
    assert placed["wall_s"] is None and "tensor_parallel_size 8, this job's 1" in placed["untimed"]
