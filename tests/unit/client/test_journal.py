"""The journal is keyed by what was asked: an answer is reused only for the very request the
current settings send (less transport-only fields); anything else is asked again, and the old
answers stay in the journal. Against the real embedded server (echo mode) on 127.0.0.1."""

import asyncio
import json
from dataclasses import replace

import httpx
from support.frames import prompt_frame
from support.generation import MODEL, fast_settings

from eaglenest.client.endpoints import Endpoint
from eaglenest.client.journal import iter_journal, match_journal, request_key
from eaglenest.demo.server_process import running_server
from eaglenest.stages.generate.generate import generate_records
from eaglenest.stages.generate.request import request_body


def requests_total(url: str) -> int:
    return httpx.get(f"{url}/stats", timeout=5).json()["requests_total"]


def run_generation(url, prompts, settings, journal):
    return asyncio.run(generate_records(prompts, [Endpoint(url)], settings, journal, "00000"))


def test_transport_fields_do_not_change_the_key():
    body = request_body("a" * 16, [{"role": "user", "content": "hi"}], fast_settings())
    assert request_key(body) == request_key(body | {"stream": True, "stream_options": {}})
    assert request_key(body) != request_key(body | {"temperature": 0.9})
    # Key order never matters.
    assert request_key(dict(reversed(list(body.items())))) == request_key(body)


def test_match_journal_sorts_every_prompt(tmp_path):
    settings = fast_settings(temperature=0.7)
    bodies = {
        i * 16: request_body(i * 16, [{"role": "user", "content": i}], settings) for i in "abcd"
    }
    changed = bodies["b" * 16] | {"temperature": 0.9}
    journal = tmp_path / "j.jsonl"
    lines = [
        {"id": "a" * 16, "request": json.dumps(bodies["a" * 16]), "error_kind": None},
        {"id": "b" * 16, "request": json.dumps(changed), "error_kind": None},
        {"id": "c" * 16, "request": json.dumps(bodies["c" * 16]), "error_kind": "http_500"},
    ]
    journal.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"id": "torn')
    matched = match_journal(journal, bodies)
    assert list(matched.reused) == ["a" * 16]
    assert matched.origins == {"b" * 16: "settings_changed", "c" * 16: "retry", "d" * 16: "new"}
    assert matched.counts() == {"journal": 1, "new": 1, "retry": 1, "settings_changed": 1}


def test_a_sampling_change_asks_every_prompt_again_and_keeps_the_old_answers(tmp_path):
    prompts = prompt_frame(12).to_dicts()
    journal = tmp_path / "journal.jsonl"
    first = fast_settings(temperature=0.7)
    with running_server(model_name=MODEL, echo=True) as url:
        records = run_generation(url, prompts, first, journal)
        assert requests_total(url) == 12
        assert {r["origin"] for r in records.values()} == {"new"}
        # Client-only settings: everything reused, nothing asked.
        client = replace(first.client, concurrency=3, timeout_s=9)
        records = run_generation(url, prompts, replace(first, client=client), journal)
        assert requests_total(url) == 12
        assert {r["origin"] for r in records.values()} == {"journal"}
        for changed in (
            {"temperature": 0.9},
            {"temperature": 0.9, "max_tokens": 77},
            {"temperature": 0.9, "max_tokens": 77, "extra_body": {"top_k": 5}},
        ):
            changed = replace(first, request=replace(first.request, **changed))
            before = requests_total(url)
            records = run_generation(url, prompts, changed, journal)
            assert requests_total(url) - before == 12, changed
            assert {r["origin"] for r in records.values()} == {"settings_changed"}
            bodies = [json.loads(r["request"]) for r in records.values()]
            assert {b["temperature"] for b in bodies} == {0.9}
            assert {b["max_tokens"] for b in bodies} == {changed.request.max_tokens}
        # Back to the first settings: their answers are still in the journal.
        before = requests_total(url)
        records = run_generation(url, prompts, first, journal)
        assert requests_total(url) == before
        assert {json.loads(r["request"])["temperature"] for r in records.values()} == {0.7}
    assert len(list(iter_journal(journal))) == 4 * 12
