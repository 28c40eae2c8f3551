"""No single bad answer kills a generation job: a malformed 200 answer, a lone surrogate (also in
a journal written before the check) and an endless or oversized body are retried, then become a
failure row; the other prompts are answered. Against aiohttp servers on 127.0.0.1 that answer as
a broken server or proxy does (support/chat_servers.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import polars as pl
import pytest
from aiohttp import web
from support.chat_servers import echo_answer, events, last_user_text, send_events, serving
from support.frames import prompt_frame
from support.generation import fast_settings

from eaglenest.client.endpoints import Endpoint
from eaglenest.formats.raw import RawSchema, write_raw
from eaglenest.stages.generate.generate import generate_records
from eaglenest.stages.generate.request import record_from_response, request_body

DEEP = b"[" * 200_000 + b"]" * 200_000  # valid JSON that json.loads cannot parse (RecursionError)
BAD_ANSWERS = {
    "choices_of_strings": (False, b'{"choices": ["x"]}'),
    "message_is_a_string": (False, b'{"choices": [{"message": "hi", "finish_reason": "stop"}]}'),
    "content_is_a_number": (
        False,
        b'{"choices": [{"message": {"content": 5}, "finish_reason": "stop"}]}',
    ),
    "not_utf8": (False, b'{"choices": [{"message": {"content": "\xff"}}]}'),
    "deep_nesting": (False, DEEP),
    "delta_is_a_string": (True, events(b'{"choices": [{"index": 0, "delta": "x"}]}')),
    "event_not_utf8": (True, events(b'{"choices": [{"index": 0, "delta": {"content": "\xff"}}]}')),
    "event_deep_nesting": (True, events(DEEP)),
}


@pytest.mark.parametrize("case", sorted(BAD_ANSWERS))
def test_a_malformed_answer_is_retried_then_a_failure_row_never_a_dead_job(tmp_path, case):
    """The prompt "question 0" always gets the bad answer, every other prompt a good one: the
    job ends, the bad prompt has a failure row after every attempt, the others are answered."""
    streamed, bad = BAD_ANSWERS[case]

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if last_user_text(body).endswith("question 0"):
            if streamed:
                return await send_events(request, bad)
            return web.Response(body=bad, content_type="application/json")
        return web.json_response(await echo_answer(body))

    prompts = prompt_frame(6).to_dicts()
    settings = dataclasses.replace(fast_settings(max_attempts=3), stream=streamed)

    async def scenario():
        async with serving(chat) as url:
            return await generate_records(prompts, [Endpoint(url)], settings, tmp_path / "j.jsonl")

    records = asyncio.run(scenario())
    bad_id = prompts[0]["id"]
    assert records[bad_id]["error_kind"] in {"malformed_answer", "malformed_json", "malformed_body"}
    assert records[bad_id]["attempts"] == 3
    assert all(records[p["id"]]["error_kind"] is None for p in prompts[1:])
    write_raw([records[p["id"]] for p in prompts], tmp_path / "raw.parquet")
    assert RawSchema.validate(pl.read_parquet(tmp_path / "raw.parquet")).height == 6


def test_a_lone_surrogate_is_retried_and_a_poisoned_journal_record_is_asked_again(tmp_path):
    asked: dict[str, int] = {}

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        text = last_user_text(body)
        asked[text] = asked.get(text, 0) + 1
        answer = await echo_answer(body)
        if asked[text] == 1:  # the first answer to each prompt holds "\ud800", valid JSON
            answer["choices"][0]["message"]["reasoning"] = "\ud800"
        return web.Response(text=json.dumps(answer), content_type="application/json")

    prompts = prompt_frame(4).to_dicts()
    settings = fast_settings()
    journal = tmp_path / "journal.jsonl"
    # A journal written before the check: prompt 0 answered with a lone surrogate.
    body = request_body(prompts[0]["id"], prompts[0]["messages"], settings)
    answer = {"choices": [{"message": {"reasoning": "\ud800", "content": "4"}}]}
    poisoned = record_from_response(prompts[0]["id"], "http://e", body, answer, "{}", 0.1, 1)
    journal.write_text(json.dumps(poisoned) + "\n")

    async def scenario():
        async with serving(chat) as url:
            return await generate_records(prompts, [Endpoint(url)], settings, journal)

    records = asyncio.run(scenario())
    assert all(r["error_kind"] is None and r["attempts"] == 2 for r in records.values())
    assert records[prompts[0]["id"]]["origin"] == "retry"
    write_raw([records[p["id"]] for p in prompts], tmp_path / "raw.parquet")  # no UnicodeError
    assert pl.read_parquet(tmp_path / "raw.parquet")["reasoning"].str.contains("\ud800").sum() == 0


def test_endless_and_oversized_bodies_are_read_with_a_cap(tmp_path, monkeypatch):
    import eaglenest.client.chat as chat_module

    monkeypatch.setattr(chat_module, "MAX_BODY_BYTES", 1 << 20, raising=False)
    big = json.dumps({"choices": [{"message": {"content": "x" * (2 << 20)}}]}).encode()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if last_user_text(body).endswith("question 1"):
            return web.Response(body=big, content_type="application/json")
        if not last_user_text(body).endswith("question 0"):
            return web.json_response(await echo_answer(body))
        response = web.StreamResponse(status=500)  # an error page that never ends
        await response.prepare(request)
        while True:
            await response.write(b"x" * 65536)
            await asyncio.sleep(0.001)

    prompts = prompt_frame(3).to_dicts()
    settings = dataclasses.replace(fast_settings(max_attempts=2), stream=True)

    async def scenario():
        async with serving(chat) as url:
            job = generate_records(prompts, [Endpoint(url)], settings, tmp_path / "j.jsonl")
            return await asyncio.wait_for(job, 30)

    records = asyncio.run(scenario())
    assert records[prompts[0]["id"]]["error_kind"] == "http_500"
    assert len(records[prompts[0]["id"]]["error"]) < 2000
    assert records[prompts[1]["id"]]["error_kind"] == "body_too_large"
    assert records[prompts[2]["id"]]["error_kind"] is None
