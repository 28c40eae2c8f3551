"""Generation against the real embedded server on 127.0.0.1 (echo mode: the client is under test,
not the model): faults, kills, dialects, secrets."""

import asyncio
import dataclasses
import email.utils
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import polars as pl
import pytest
from support.frames import prompt_frame
from support.generation import MODEL, fast_settings, shard_settings

from eaglenest.client.endpoints import Endpoint
from eaglenest.client.journal import iter_journal
from eaglenest.common.config import validate_config
from eaglenest.common.io import write_json
from eaglenest.demo.server_process import running_server
from eaglenest.formats.raw import RAW_SCHEMA, RawSchema, write_raw
from eaglenest.stages.generate.generate import GenerationError, generate_records, generate_shard
from eaglenest.stages.generate.request import record_from_response, sample_seed


def server_stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=5).json()


def test_every_prompt_answered_once_despite_faults(tmp_path):
    prompts = prompt_frame(200).to_dicts()
    faults = {
        "error_500": 0.10,
        "rate_limit_429": 0.05,
        "hang": 0.03,
        "malformed": 0.02,
        "drop_connection": 0.02,
    }
    journal = tmp_path / "journal.jsonl"
    with running_server(
        model_name=MODEL,
        echo=True,
        echo_latency_s=0.01,
        faults=faults,
        fault_seed=7,
        hang_s=30,
        retry_after_s=0.1,
    ) as url:
        records = asyncio.run(
            generate_records(prompts, [Endpoint(url)], fast_settings(), journal, "00000")
        )
        stats = server_stats(url)
    ids = [p["id"] for p in prompts]
    assert sorted(records) == sorted(ids)
    assert all(r["error_kind"] is None for r in records.values())
    assert all(
        r["reasoning"].strip() and r["reasoning_field"] == "reasoning" for r in records.values()
    )
    journal_ids = [json.loads(line)["id"] for line in journal.read_text().splitlines()]
    assert sorted(journal_ids) == sorted(ids), "each prompt journaled exactly once"
    # The faults really happened, and retries covered them.
    assert sum(stats["faults"].values()) >= 20
    assert max(r["attempts"] for r in records.values()) > 1


def test_terminal_4xx_is_not_retried_and_fails_the_shard(tmp_path):
    prompts_path = tmp_path / "prompts.parquet"
    prompt_frame(10).write_parquet(prompts_path)
    probe = tmp_path / "probe.json"
    write_json(probe, {"token_ids": {"supported": True}, "reasoning_field": "reasoning"})
    with running_server(model_name=MODEL, echo=True) as url:
        config = validate_config(
            {
                "target": {"model": "wrong-model"},
                "endpoints": [{"url": url}],
                "generation": {"timeout_s": 5},
            }
        )
        with pytest.raises(GenerationError, match=r"10 of 10 requests failed .*http_404"):
            generate_shard(
                prompts_path,
                probe,
                tmp_path / "raw.parquet",
                *shard_settings(config),
                tmp_path / "journal.jsonl",
                shard="00000",
            )
        assert server_stats(url)["requests_total"] == 10  # one each: a 404 is not worth retrying
    assert not (tmp_path / "raw.parquet").exists()
    assert len({record["id"] for record in iter_journal(tmp_path / "journal.jsonl")}) == 10


@pytest.mark.parametrize(
    ("dialect", "field", "layout"),
    [
        ("sglang", "reasoning_content", "sglang"),
        ("none", "content_think_tags", "vllm"),
        ("vllm", "reasoning", "vllm"),
    ],
)
def test_each_dialect_is_captured_and_recorded(tmp_path, dialect, field, layout):
    """Streamed where the probe's layout streams ids (vllm), plain for SGLang's."""
    prompts_path = tmp_path / "prompts.parquet"
    prompt_frame(20).write_parquet(prompts_path)
    probe = tmp_path / "probe.json"
    write_json(probe, {"token_ids": {"supported": True, "layout": layout}})
    out = tmp_path / "raw.parquet"
    with running_server(model_name=MODEL, dialect=dialect, echo=True) as url:
        config = validate_config({"target": {"model": MODEL}, "endpoints": [{"url": url}]})
        generate_shard(
            prompts_path, probe, out, *shard_settings(config), tmp_path / "j.jsonl", shard="00000"
        )
    raw = pl.read_parquet(out)
    RawSchema.validate(raw)
    assert raw["reasoning_field"].unique().to_list() == [field]
    assert all(r.strip() for r in raw["reasoning"].to_list())
    assert all("<think>" not in c and "</think>" not in c for c in raw["content"].to_list())
    assert raw["token_layout"].unique().to_list() == [layout]
    body = json.loads(raw["request"][0])
    assert body["seed"] == sample_seed(0, raw["id"][0])
    assert body["return_token_ids"] is True


KILL_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, polars as pl
    from eaglenest.client.endpoints import Endpoint
    from eaglenest.common.config import validate_config
    from eaglenest.settings.generate import GenerationClientSettings, RequestSettings
    from eaglenest.stages.generate.request import GenerationSettings
    from eaglenest.stages.generate.generate import generate_records
    prompts = pl.read_parquet(sys.argv[1]).to_dicts()
    config = validate_config({"target": {"model": "echo-model"}, "generation": {"concurrency": 4}})
    settings = GenerationSettings.from_parts(
        RequestSettings.from_config(config), GenerationClientSettings.from_config(config), True
    )
    asyncio.run(generate_records(prompts, [Endpoint(sys.argv[2])], settings, __import__("pathlib").Path(sys.argv[3])))
    """
)


def test_kill_mid_shard_then_rerun_loses_nothing_and_repeats_nothing(tmp_path):
    frame = prompt_frame(200)
    prompts_path = tmp_path / "prompts.parquet"
    frame.write_parquet(prompts_path)
    journal = tmp_path / "journal.jsonl"
    with running_server(model_name=MODEL, echo=True, echo_latency_s=0.05) as url:
        child = subprocess.Popen(
            [sys.executable, "-c", KILL_SCRIPT, str(prompts_path), url, str(journal)],
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if journal.exists() and journal.read_text().count("\n") >= 40:
                break
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    # The answers journaled before the kill, by id (the first of each, as the rerun reuses it).
    before: dict[str, dict] = {}
    for record in iter_journal(journal):
        if record["error_kind"] is None:
            before.setdefault(record["id"], record)
    assert 40 <= len(before) < 200, "the kill landed mid-shard"
    probe = tmp_path / "probe.json"
    write_json(probe, {"token_ids": {"supported": True}})
    out = tmp_path / "raw.parquet"
    with running_server(model_name=MODEL, echo=True) as url:
        config = validate_config({"target": {"model": MODEL}, "endpoints": [{"url": url}]})
        generate_shard(prompts_path, probe, out, *shard_settings(config), journal, shard="00000")
        requested_after_kill = server_stats(url)["requests_total"]
    raw = pl.read_parquet(out)
    assert raw["id"].to_list() == frame["id"].to_list()
    assert requested_after_kill == 200 - len(before)
    kept = raw.filter(pl.col("id").is_in(list(before)))
    assert kept["response"].to_list() == [before[i]["response"] for i in kept["id"].to_list()]


def test_api_key_reaches_no_file(tmp_path, monkeypatch):
    secret = "sk-eaglenest-test-" + "7" * 20
    monkeypatch.setenv("EAGLENEST_TEST_API_KEY", secret)
    prompts_path = tmp_path / "prompts.parquet"
    prompt_frame(10).write_parquet(prompts_path)
    probe = tmp_path / "probe.json"
    write_json(probe, {"token_ids": {"supported": True}})
    with running_server(model_name=MODEL, echo=True, faults={"error_500": 0.3}) as url:
        config = validate_config(
            {
                "target": {"model": MODEL},
                "endpoints": [{"url": url, "api_key_env": "EAGLENEST_TEST_API_KEY"}],
                "generation": {"backoff_base_s": 0.01},
            }
        )
        generate_shard(
            prompts_path,
            probe,
            tmp_path / "raw.parquet",
            *shard_settings(config),
            tmp_path / "journal.jsonl",
            shard="00000",
        )
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_a_short_api_key_never_changes_the_models_text(tmp_path, monkeypatch):
    # vLLM's usual dummy key: redacting it from answers would corrupt every "EMPTY" the model says.
    monkeypatch.setenv("EAGLENEST_TEST_API_KEY", "EMPTY")
    frame = pl.DataFrame(
        [{"id": "e" * 16, "messages": [{"role": "user", "content": "Is the box EMPTY?"}]}]
    )
    with running_server(model_name=MODEL, echo=True) as url:
        endpoint = Endpoint(url, api_key_env="EAGLENEST_TEST_API_KEY")
        records = asyncio.run(
            generate_records(frame.to_dicts(), [endpoint], fast_settings(), tmp_path / "j.jsonl")
        )
    record = records["e" * 16]
    assert record["content"].endswith("Is the box EMPTY?")
    assert "Is the box EMPTY?" in json.loads(record["response"])["choices"][0]["message"]["content"]


def test_retry_after_reads_seconds_and_http_dates():
    from eaglenest.client.chat import retry_after_s

    now = 1_700_000_000.0
    assert retry_after_s("7", now) == 7.0
    assert retry_after_s("1.5", now) == 1.5
    assert retry_after_s(None, now) is None
    assert retry_after_s("soon", now) is None
    date = email.utils.formatdate(now + 42, usegmt=True)  # e.g. "Tue, 14 Nov 2023 22:14:02 GMT"
    assert retry_after_s(date, now) == pytest.approx(42, abs=1)
    assert retry_after_s(email.utils.formatdate(now - 60, usegmt=True), now) == 0.0


def test_retry_after_is_honoured_up_to_the_cap():
    settings = fast_settings(retry_after_max_s=5.0)
    assert settings.retry.backoff_s(1, 3.0) == 3.0
    assert settings.retry.backoff_s(1, 86_400.0) == 5.0


def test_an_answer_from_another_model_is_a_terminal_failure(tmp_path):
    """A router that answers with another model than the one asked for: an independent server on
    127.0.0.1 that always says it is `other-model`."""
    from aiohttp import web

    from eaglenest.demo.echo_backend import EchoBackend
    from eaglenest.demo.protocol import build_response, parse_chat_request

    async def chat(request):
        completion = await EchoBackend().complete(parse_chat_request(await request.json()))
        return web.json_response(
            build_response(
                completion, model_name="other-model", dialect="vllm", return_token_ids=True
            )
        )

    async def scenario():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await generate_records(
                prompt_frame(3).to_dicts(),
                [Endpoint(f"http://127.0.0.1:{port}")],
                fast_settings(),
                tmp_path / "j.jsonl",
            )
        finally:
            await runner.cleanup()

    records = asyncio.run(scenario())
    assert {r["error_kind"] for r in records.values()} == {"model_mismatch"}
    assert all("other-model" in r["error"] for r in records.values())
    assert {r["attempts"] for r in records.values()} == {1}


# -- token ids that are not ids -------------------------------------------------------------


def vllm_answer(completion_ids: list, prompt_ids: list | None = None) -> dict:
    return {
        "prompt_token_ids": [1, 2] if prompt_ids is None else prompt_ids,
        "choices": [
            {
                "message": {"content": "\n\n4", "reasoning": "\nthink\n"},
                "finish_reason": "stop",
                "token_ids": completion_ids,
            }
        ],
    }


@pytest.mark.parametrize(
    ("completion_ids", "prompt_ids", "problem"),
    [
        (["12", 7.5, None, -1, 999999], None, 'completion_token_ids[0] is "12", not an integer'),
        ([3, 7.5], None, "completion_token_ids[1] is 7.5, not an integer"),  # not truncated to 7
        ([3, None], None, "completion_token_ids[1] is null, not an integer"),
        ([3, True], None, "completion_token_ids[1] is true, not an integer"),
        ([3, 4], [1, 2**64], f"prompt_token_ids[1] is {2**64}, beyond a 64-bit integer"),
    ],
)
def test_ids_that_are_not_integers_are_marked_not_coerced(
    tmp_path, completion_ids, prompt_ids, problem
):
    answer = vllm_answer(completion_ids, prompt_ids)
    text = json.dumps(answer)
    record = record_from_response("a" * 16, "http://e", {}, answer, text, 0.1, 1)
    assert record["token_ids_error"] == problem
    assert record["prompt_token_ids"] is None and record["completion_token_ids"] is None
    assert record["token_layout"] == "vllm" and record["response"] == text
    write_raw([record], tmp_path / "raw.parquet")  # no TypeError, nothing coerced
    raw = RawSchema.validate(pl.read_parquet(tmp_path / "raw.parquet"))
    assert raw.row(0, named=True) == dict.fromkeys(RAW_SCHEMA) | record


def test_integer_ids_out_of_range_are_kept_for_validation_to_judge():
    answer = vllm_answer([-1, 999999])
    record = record_from_response("a" * 16, "http://e", {}, answer, "{}", 0.1, 1)
    assert record["token_ids_error"] is None
    assert record["completion_token_ids"] == [-1, 999999]


def test_a_journal_written_before_the_check_still_makes_a_raw_file(tmp_path):
    """Records journaled by a version without the check hold the server's ids as sent, and no
    token_ids_error key; write_raw marks them instead of crashing on them."""
    good = record_from_response("a" * 16, "http://e", {}, vllm_answer([3, 4]), "{}", 0.1, 1)
    old = dict(good, id="b" * 16, completion_token_ids=["12", 7.5, None, -1, 999999])
    del good["token_ids_error"], old["token_ids_error"]
    write_raw([good, old], tmp_path / "raw.parquet")
    raw = RawSchema.validate(pl.read_parquet(tmp_path / "raw.parquet"))
    assert raw["token_ids_error"].to_list() == [
        None,
        'completion_token_ids[0] is "12", not an integer',
    ]
    assert raw["completion_token_ids"].to_list() == [[3, 4], None]


def test_a_streamed_answer_longer_than_timeout_s_completes(tmp_path):
    """Chunks keep coming for 3 s: streamed, timeout_s (1 s) does not cut it; the same request
    not streamed is cut by it."""
    prompts = prompt_frame(4).to_dicts()
    with running_server(model_name=MODEL, echo=True, echo_latency_s=3.0) as url:
        streamed = dataclasses.replace(
            fast_settings(timeout_s=1.0, idle_timeout_s=1.0, max_attempts=1), stream=True
        )
        records = asyncio.run(
            generate_records(prompts, [Endpoint(url)], streamed, tmp_path / "s.jsonl", "00000")
        )
        plain = dataclasses.replace(streamed, stream=False)
        cut = asyncio.run(
            generate_records(prompts, [Endpoint(url)], plain, tmp_path / "p.jsonl", "00000")
        )
    assert all(r["error_kind"] is None for r in records.values())
    assert all(r["latency_s"] > 2.5 and r["completion_token_ids"] for r in records.values())
    assert all(r["reasoning_field"] == "reasoning" for r in records.values())
    assert {r["error_kind"] for r in cut.values()} == {"timeout"}


def test_a_stalled_stream_fails_after_idle_timeout_and_is_retried(tmp_path):
    prompts = prompt_frame(40).to_dicts()
    journal = tmp_path / "journal.jsonl"
    with running_server(
        model_name=MODEL, echo=True, faults={"stall_stream": 0.2}, fault_seed=1, hang_s=30
    ) as url:
        settings = dataclasses.replace(fast_settings(idle_timeout_s=0.5), stream=True)
        started = time.monotonic()
        records = asyncio.run(
            generate_records(prompts, [Endpoint(url)], settings, journal, "00000")
        )
        elapsed = time.monotonic() - started
        stats = server_stats(url)
    assert stats["faults"]["stall_stream"] >= 5
    assert all(r["error_kind"] is None for r in records.values())
    assert sum(r["attempts"] - 1 for r in records.values()) == stats["faults"]["stall_stream"]
    assert elapsed < 20, "stalled streams were given up after idle_timeout_s, not hang_s"
    journal_ids = [json.loads(line)["id"] for line in journal.read_text().splitlines()]
    assert sorted(journal_ids) == sorted(p["id"] for p in prompts)


def test_the_streamed_record_equals_the_plain_one(tmp_path):
    """Same raw row (text, reasoning field, ids, usage) whichever way the answer travelled."""
    prompts = prompt_frame(6).to_dicts()
    with running_server(model_name=MODEL, echo=True) as url:
        rows = {}
        for stream in (True, False):
            settings = dataclasses.replace(fast_settings(), stream=stream)
            rows[stream] = asyncio.run(
                generate_records(
                    prompts, [Endpoint(url)], settings, tmp_path / f"{stream}.jsonl", "00000"
                )
            )
    same = ("reasoning", "content", "reasoning_field", "finish_reason", "prompt_token_ids")
    same += ("completion_token_ids", "token_layout", "prompt_tokens", "completion_tokens")
    for sample_id, plain in rows[False].items():
        streamed = rows[True][sample_id]
        assert {k: streamed[k] for k in same} == {k: plain[k] for k in same}
