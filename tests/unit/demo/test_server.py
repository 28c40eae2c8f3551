"""Tests of `eaglenest serve` and `server_process`: real servers on 127.0.0.1, real HTTP clients.

Model tests run the trained demo target (the session fixture `demo_target_dir`), which answers
held-out prompts with `<think>\n...\n</think>\n\nanswer<|im_end|>`; echo tests need no model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from math import sqrt
from pathlib import Path

import httpx
import pytest

from eaglenest.common.reasoning import split_think
from eaglenest.demo.echo_backend import (
    ECHO_REASONING,
    ECHO_STOP_TOKEN,
    echo_decode,
    render_echo_prompt,
)
from eaglenest.demo.faults import FAULT_MODES, FaultConfig, FaultInjector
from eaglenest.demo.protocol import MALFORMED_TOKEN_IDS
from eaglenest.demo.server_process import embedded_server, running_server
from eaglenest.demo.tasks import heldout_examples

MODEL_NAME = "demo-target"
PROMPTS = [example.prompt for example in heldout_examples(seed=0, n=32)]
QUESTION = PROMPTS[0]


@pytest.fixture(scope="module")
def tokenizer(demo_target_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_target_dir)


@pytest.fixture(scope="module")
def model_servers(demo_target_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One model server per dialect, started in parallel (startup is mostly imports)."""
    logs = tmp_path_factory.mktemp("server-logs")
    config = {
        "target": {"path": str(demo_target_dir), "model": MODEL_NAME},
        "server": {"dialect": "vllm", "faults": {"seed": 3, "hang_s": 5, "retry_after_s": 2}},
    }
    managers = {
        # vllm goes through embedded_server, the way pipeline jobs start it.
        "vllm": embedded_server(config, log_path=logs / "vllm.log", threads=1),
        **{
            dialect: running_server(
                demo_target_dir,
                model_name=MODEL_NAME,
                dialect=dialect,
                log_path=logs / f"{dialect}.log",
                threads=1,
            )
            for dialect in ("sglang", "none")
        },
    }
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(managers)) as pool:
        started = {dialect: pool.submit(m.__enter__) for dialect, m in managers.items()}
        urls, errors = {}, []
        for dialect, future in started.items():
            try:
                urls[dialect] = future.result()
                stack.push(managers[dialect].__exit__)
            except RuntimeError as error:
                errors.append(error)
        if errors:
            raise errors[0]
        yield urls


def chat(url: str, body: dict, timeout_s: float = 30.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout_s)


def user(text: str = QUESTION) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# -- routes and request checking ----------------------------------------------------------------


def test_health_models_stats_and_request_errors(model_servers):
    url = model_servers["vllm"]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL_NAME]
    stats = httpx.get(f"{url}/stats").json()
    # embedded_server mapped the config's fault section onto the server.
    assert (stats["fault_seed"], stats["hang_s"], stats["retry_after_s"]) == (3, 5, 2)

    wrong_model = chat(url, {"model": "gpt-4", "messages": user()})
    assert wrong_model.status_code == 404
    error = wrong_model.json()["error"]
    assert "gpt-4" in error["message"] and MODEL_NAME in error["message"]
    assert error["param"] == "model"

    cases = [
        ({"model": MODEL_NAME}, "messages"),
        ({"messages": user(), "temperature": "hot"}, "temperature"),
        ({"messages": user(), "max_tokens": 0}, "max_tokens"),
        ({"messages": user(), "stream": "yes"}, "stream"),
        ({"messages": user(), "top_p": 1.5}, "top_p"),
        ({"messages": [{"content": "no role"}]}, "messages"),
    ]
    for body, named in cases:
        response = chat(url, body)
        assert response.status_code == 400, body
        assert named in response.json()["error"]["message"], response.json()
    not_json = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=10)
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]


# -- dialects and token ids ---------------------------------------------------------------------


def token_ids(result: dict, dialect: str) -> tuple[list[int], list[int]]:
    choice = result["choices"][0]
    if dialect == "sglang":
        return choice["prompt_token_ids"], choice["response_token_ids"]
    return result["prompt_token_ids"], choice["token_ids"]


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "none"])
def test_model_dialect_fields_and_token_ids(model_servers, tokenizer, dialect):
    think_ids = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    with_reasoning = 0
    for question in PROMPTS[:5]:
        body = {"messages": user(question), "temperature": 0, "return_token_ids": True}
        response = chat(model_servers[dialect], body)
        assert response.status_code == 200, response.text
        result = response.json()
        message = result["choices"][0]["message"]
        prompt_ids, completion_ids = token_ids(result, dialect)
        # The generated text, as the model produced it, minus the stop token.
        generated = tokenizer.decode(completion_ids[:-1], skip_special_tokens=False)
        reasoning, content = split_think(generated)
        field = {"vllm": "reasoning", "sglang": "reasoning_content"}.get(dialect)
        other_fields = {"reasoning", "reasoning_content"} - {field}
        assert not other_fields & set(message), message
        if field is None:
            assert message["content"] == generated  # no parser: think tags inline
        else:
            assert (message[field], message["content"]) == (reasoning, content)
        if reasoning:
            with_reasoning += 1
            # Exactly the tokens the model saw and produced, think and stop tokens included.
            rendered = tokenizer.apply_chat_template(
                user(question), tokenize=False, add_generation_prompt=True
            )
            full = tokenizer.decode(prompt_ids + completion_ids, skip_special_tokens=False)
            assert full == f"{rendered}<think>{reasoning}</think>{content}<|im_end|>"
            assert set(think_ids) <= set(completion_ids)
            assert result["choices"][0]["finish_reason"] == "stop"
            assert completion_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert result["usage"] == {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(completion_ids),
            "total_tokens": len(prompt_ids) + len(completion_ids),
        }
    assert with_reasoning, f"{dialect}: no answer carried reasoning"


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "none"])
def test_echo_dialects(dialect):
    messages = [{"role": "system", "content": "Be brief."}, *user("Echo me, ünïcode ✓")]
    with running_server(echo=True, model_name="echo", dialect=dialect) as url:
        response = chat(url, {"model": "echo", "messages": messages, "return_token_ids": True})
    assert response.status_code == 200, response.text
    result = response.json()
    choice = result["choices"][0]
    message = choice["message"]
    field = {"vllm": "reasoning", "sglang": "reasoning_content"}.get(dialect)
    answer = "\n\nEcho me, ünïcode ✓"
    if field is None:
        assert message["content"] == f"<think>{ECHO_REASONING}</think>{answer}"
    else:
        assert message[field] == ECHO_REASONING and message["content"] == answer
    if dialect == "sglang":
        prompt_ids, completion_ids = choice["prompt_token_ids"], choice["response_token_ids"]
    else:
        prompt_ids, completion_ids = result["prompt_token_ids"], choice["token_ids"]
    expected = f"{render_echo_prompt(messages)}<think>{ECHO_REASONING}</think>{answer}"
    assert echo_decode(prompt_ids + completion_ids) == expected + ECHO_STOP_TOKEN
    assert result["usage"]["completion_tokens"] == len(completion_ids)
    assert result["usage"]["prompt_tokens"] == len(prompt_ids)


def test_echo_length_limit_and_a_server_without_token_ids():
    with running_server(echo=True, model_name="echo", extra_args=["--no-token-ids"]) as url:
        body = {"messages": user("hi"), "max_tokens": 4, "return_token_ids": True}
        result = chat(url, body).json()
    choice = result["choices"][0]
    assert "prompt_token_ids" not in result and "token_ids" not in choice
    assert choice["finish_reason"] == "length" and result["usage"]["completion_tokens"] == 4
    # <think> is one token, then three bytes of the reasoning; no end tag: all reasoning.
    assert choice["message"]["reasoning"] == ECHO_REASONING[:3]
    assert choice["message"]["content"] is None


def test_length_limit_and_max_completion_tokens(model_servers, tokenizer):
    for limit in ({"max_tokens": 3}, {"max_completion_tokens": 3, "max_tokens": 50}):
        body = {"messages": user(), "temperature": 0, "return_token_ids": True, **limit}
        result = chat(model_servers["vllm"], body).json()
        choice = result["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["token_ids"]) == 3 and result["usage"]["completion_tokens"] == 3
        # Cut inside the think block: all reasoning, no content (as reasoning parsers report it).
        generated = tokenizer.decode(choice["token_ids"], skip_special_tokens=False)
        assert generated.startswith("<think>")
        assert choice["message"]["reasoning"] == generated.removeprefix("<think>")
        assert choice["message"]["content"] is None


# -- clients ------------------------------------------------------------------------------------


def test_official_openai_client_and_raw_httpx(model_servers, tokenizer):
    from openai import OpenAI

    url = model_servers["vllm"]
    client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    completion = client.chat.completions.create(
        model=MODEL_NAME,
        messages=user(),
        temperature=0,
        max_tokens=64,
        extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    message = completion.choices[0].message
    completion_ids = completion.choices[0].model_extra["token_ids"]
    generated = tokenizer.decode(completion_ids[:-1], skip_special_tokens=False)
    assert (message.model_extra["reasoning"], message.content) == split_think(generated)
    prompt_ids = completion.model_extra["prompt_token_ids"]
    # The request's chat_template_kwargs reached the template: it pre-filled an empty think block.
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.usage.completion_tokens == len(completion_ids)

    raw = httpx.post(
        f"{url}/v1/chat/completions",
        content=json.dumps({"model": MODEL_NAME, "messages": user(), "temperature": 0}),
        headers={"Content-Type": "application/json", "Authorization": "Bearer x"},
        timeout=30,
    )
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("application/json")
    body = raw.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL_NAME
    assert body["choices"][0]["message"]["reasoning"]
    assert "prompt_token_ids" not in body  # only when asked for


def test_seeded_sampling_is_reproducible(model_servers):
    def sample(seed: int) -> list[int]:
        body = {"messages": user(), "temperature": 50.0, "top_p": 0.95, "seed": seed}
        body.update(max_tokens=16, return_token_ids=True)
        return chat(model_servers["vllm"], body).json()["choices"][0]["token_ids"]

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    assert first != other


def test_concurrent_requests_are_batched(model_servers):
    url = model_servers["vllm"]
    # Mostly long sampled answers (the work batching shares); every 4th is greedy, which must
    # give the same answer alone and inside a left-padded batch.
    bodies = [
        {"messages": user(PROMPTS[i]), "max_tokens": 32, "seed": i}
        | ({"temperature": 0} if i % 4 == 0 else {"temperature": 50.0})
        for i in range(32)
    ]

    async def send_all(concurrent: bool) -> tuple[float, list[dict]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            await client.get("/health")  # connect before timing

            async def one(body: dict) -> dict:
                response = await client.post("/v1/chat/completions", json=body)
                return response.json()["choices"][0]

            start = time.perf_counter()
            if concurrent:
                results = await asyncio.gather(*(one(b) for b in bodies))
            else:
                results = [await one(b) for b in bodies]
            return time.perf_counter() - start, list(results)

    batches_before = httpx.get(f"{url}/stats").json()["backend"]["batches"]
    sequential_s, sequential = asyncio.run(send_all(concurrent=False))
    concurrent_s, concurrent = asyncio.run(send_all(concurrent=True))
    stats = httpx.get(f"{url}/stats").json()["backend"]
    print(
        f"32 requests: sequential {sequential_s:.2f} s, concurrent {concurrent_s:.2f} s "
        f"(ratio {concurrent_s / sequential_s:.2f}); batches {stats['batches'] - batches_before}, "
        f"largest batch {stats['max_batch_size_seen']}"
    )
    greedy = range(0, 32, 4)
    assert [concurrent[i]["message"] for i in greedy] == [sequential[i]["message"] for i in greedy]
    assert stats["max_batch_size_seen"] > 1
    assert concurrent_s < 0.6 * sequential_s


# -- faults -------------------------------------------------------------------------------------


def classify(outcome: httpx.Response | Exception) -> str:
    """The fault a client observed (or "ok")."""
    if isinstance(outcome, httpx.TimeoutException):
        return "hang"
    if isinstance(outcome, httpx.TransportError):
        return "drop_connection"
    assert isinstance(outcome, httpx.Response), outcome
    if outcome.status_code == 500:
        return "error_500"
    if outcome.status_code == 429:
        assert outcome.headers["retry-after"] == "2"
        return "rate_limit_429"
    assert outcome.status_code == 200, outcome.text
    try:
        choice = outcome.json()["choices"][0]
    except json.JSONDecodeError:
        return "malformed"
    message = choice["message"]
    if "token_ids" in choice:  # these requests do not ask for ids: only the fault sends them
        assert choice["token_ids"] == MALFORMED_TOKEN_IDS
        assert message["reasoning"] == ECHO_REASONING
        return "bad_token_ids"
    if message["reasoning"] is None:
        assert "<think>" not in message["content"] and message["content"] == "\n\nhello"
        return "drop_reasoning"
    assert message["reasoning"] == ECHO_REASONING
    return "ok"


def test_faults_happen_at_their_configured_rates_and_the_server_survives():
    # stall_stream stalls a stream (tests/unit/stages/generate/test_generate.py); to these plain requests it is a hang.
    rates = {mode: 0.1 for mode in FAULT_MODES if mode != "stall_stream"} | {"hang": 0.03}
    n_requests, seed = 200, 1234
    injector = FaultInjector(FaultConfig(rates=rates, seed=seed))  # as a fresh server draws
    for _ in range(n_requests):
        injector.draw()
    expected = dict(injector.counts)
    client_timeout_s = 3.0

    async def storm(url: str) -> list[str]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(
            base_url=url, timeout=client_timeout_s, limits=limits
        ) as client:
            gate = asyncio.Semaphore(32)

            async def one() -> str:
                async with gate:
                    try:
                        outcome = await client.post(
                            "/v1/chat/completions", json={"messages": user("hello")}
                        )
                    except httpx.HTTPError as error:
                        return classify(error)
                    return classify(outcome)

            return await asyncio.gather(*(one() for _ in range(n_requests)))

    with running_server(
        echo=True, model_name="echo", faults=rates, fault_seed=seed, hang_s=60, retry_after_s=2
    ) as url:
        observed = asyncio.run(storm(url))
        stats = httpx.get(f"{url}/stats").json()
        # Still serving: /health is never faulted, and chat requests keep getting answers.
        assert httpx.get(f"{url}/health").status_code == 200
        after = [classify(_post_or_error(url)) for _ in range(20)]
    counts = {mode: observed.count(mode) for mode in FAULT_MODES}
    print(f"faults over {n_requests} requests: {counts}")
    assert counts == expected == stats["faults"]
    assert stats["requests_total"] == n_requests
    assert observed.count("ok") == n_requests - sum(expected.values())
    for mode, rate in rates.items():
        mean, spread = n_requests * rate, sqrt(n_requests * rate * (1 - rate))
        assert abs(counts[mode] - mean) <= 4 * spread, (mode, counts[mode], mean)
    assert "ok" in after


def _post_or_error(url: str) -> httpx.Response | Exception:
    try:
        return httpx.post(f"{url}/v1/chat/completions", json={"messages": user("hello")}, timeout=3)
    except httpx.HTTPError as error:
        return error


# -- server_process -----------------------------------------------------------------------------


def test_running_server_stops_the_server_on_exceptions():
    with (
        pytest.raises(ValueError, match="inside the block"),
        running_server(echo=True, model_name="echo") as url,
    ):
        assert urllib.request.urlopen(f"{url}/health", timeout=5).status == 200
        raise ValueError("inside the block")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=2)


def test_running_server_reports_a_failed_startup_with_its_log(tmp_path: Path):
    log_path = tmp_path / "server.log"
    with (
        pytest.raises(RuntimeError, match="unknown mode 'bogus'") as failure,
        running_server(
            echo=True, model_name="echo", log_path=log_path, extra_args=["--fault", "bogus=1"]
        ),
    ):
        pass
    assert "exited with code" in str(failure.value) and str(log_path) in str(failure.value)


@pytest.mark.parametrize(("token_ids", "extra_args"), [(True, ()), (False, ("--no-token-ids",))])
def test_embedded_server_token_ids_setting_maps_to_the_server_flag(
    monkeypatch: pytest.MonkeyPatch, token_ids: bool, extra_args: tuple[str, ...]
):
    """`server.token_ids: false` starts the server with --no-token-ids (config/tests/rebuild-path)."""
    from eaglenest.common.config import validate_config
    from eaglenest.demo import server_process

    started = {}
    monkeypatch.setattr(
        server_process, "running_server", lambda *args, **kwargs: started.update(kwargs)
    )
    config = {"target": {"path": "target"}, "server": {"enabled": True, "token_ids": token_ids}}
    server_process.embedded_server(validate_config(config))
    assert tuple(started["extra_args"]) == extra_args
