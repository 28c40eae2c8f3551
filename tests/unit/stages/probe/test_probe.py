"""The probe against the real embedded server on 127.0.0.1: it passes on every dialect and fails in
seconds, with a message that says what to fix, on the failures that cost real runs days."""

import json
import subprocess
import sys
import time

import pytest
from support.servers import free_port

from eaglenest.client.endpoints import Endpoint
from eaglenest.demo.server_process import running_server
from eaglenest.stages.probe import ProbeError, probe_endpoint
from eaglenest.target_model.tokenizer import think_token_ids

MODEL = "echo-model"


@pytest.mark.parametrize(
    ("dialect", "field", "layout"),
    [
        ("vllm", "reasoning", "vllm"),
        ("sglang", "reasoning_content", "sglang"),
        # vLLM without a reasoning parser: think tags inline, token ids still returned.
        ("none", "content_think_tags", "vllm"),
    ],
)
def test_probe_detects_each_dialect(dialect, field, layout):
    with running_server(model_name=MODEL, dialect=dialect, echo=True) as url:
        result = probe_endpoint(Endpoint(url=url + "/v1"), MODEL)
    assert result["reasoning_field"] == field
    assert result["reasoning_preview"].strip()
    assert result["token_ids"]["layout"] == layout
    assert result["raw_response"]["choices"][0]["message"]


def test_probe_on_the_demo_target_reports_think_ids_and_token_ids(demo_target_dir):
    with running_server(demo_target_dir, model_name="demo", dialect="vllm") as url:
        result = probe_endpoint(Endpoint(url=url), "demo", max_tokens=64, require_token_ids=True)
    think = think_token_ids(str(demo_target_dir))
    assert think["source"] == "tokenizer"
    assert result["reasoning_field"] == "reasoning"
    assert result["token_ids"]["supported"]
    completion_ids = result["raw_response"]["choices"][0]["token_ids"]
    assert think["start_id"] in completion_ids


def test_probe_fails_on_a_server_that_drops_reasoning():
    with running_server(model_name=MODEL, echo=True, faults={"drop_reasoning": 1.0}) as url:
        started = time.monotonic()
        with pytest.raises(ProbeError) as err:
            probe_endpoint(Endpoint(url=url), MODEL)
    message = str(err.value)
    assert "reasoning is empty in every field" in message
    assert "reasoning_content: absent" in message or "reasoning_content: null" in message
    assert "--reasoning-parser" in message
    assert time.monotonic() - started < 10


def test_probe_fails_on_a_wrong_model_name_listing_served_ones():
    with (
        running_server(model_name=MODEL, echo=True) as url,
        pytest.raises(ProbeError, match=r"model 'Kimi-K2\.5' is not served .*echo-model"),
    ):
        probe_endpoint(Endpoint(url=url), "Kimi-K2.5")


def test_probe_fails_fast_on_a_closed_port():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(ProbeError, match="unreachable"):
        probe_endpoint(Endpoint(url=f"http://127.0.0.1:{port}"), MODEL)
    assert time.monotonic() - started < 10


def test_probe_requires_token_ids_when_configured():
    # An older server that ignores return_token_ids.
    with (
        running_server(model_name=MODEL, echo=True, extra_args=["--no-token-ids"]) as url,
        pytest.raises(ProbeError, match="no token ids"),
    ):
        probe_endpoint(Endpoint(url=url), MODEL, require_token_ids=True)


def test_probe_survives_transient_faults():
    with running_server(
        model_name=MODEL, echo=True, faults={"error_500": 0.5}, fault_seed=3
    ) as url:
        result = probe_endpoint(Endpoint(url=url), MODEL)
    assert result["reasoning_field"] == "reasoning"


def test_api_key_never_reaches_the_probe_output(tmp_path, monkeypatch):
    secret = "sk-test-" + "x" * 24
    monkeypatch.setenv("EAGLENEST_TEST_KEY", secret)
    out = tmp_path / "probe.json"
    with running_server(model_name=MODEL, echo=True) as url:
        code = subprocess.run(
            [
                sys.executable,
                "-m",
                "eaglenest.cli",
                "probe",
                "--endpoint",
                url,
                "--model",
                MODEL,
                "--api-key-env",
                "EAGLENEST_TEST_KEY",
                "--out",
                str(out),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert code.returncode == 0, code.stdout + code.stderr
    assert "reasoning field: reasoning" in code.stdout
    assert secret not in out.read_text() + code.stdout + code.stderr
    assert json.loads(out.read_text())["reasoning_field"] == "reasoning"


def test_cli_probe_exits_nonzero_with_the_message():
    with running_server(model_name=MODEL, echo=True) as url:
        code = subprocess.run(
            [sys.executable, "-m", "eaglenest.cli", "probe", "--endpoint", url, "--model", "nope"],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert code.returncode == 1
    assert "not served" in code.stdout


def user(text):
    return [{"role": "user", "content": text}]


def test_one_answer_without_reasoning_is_a_warning_not_a_failure(caplog):
    """A real target may skip thinking on one prompt (here Qwen3's /no_think switch, which the
    echo server honours): the probe goes on and says how many answers had no reasoning."""
    prompts = [user("What is 2 + 2? /no_think"), user("Sort 3, 1, 2."), user("Count to 3.")]
    with running_server(model_name=MODEL, echo=True) as url, caplog.at_level("WARNING"):
        result = probe_endpoint(Endpoint(url=url), MODEL, prompts=prompts)
    assert result["reasoning_field"] == "reasoning"
    assert result["answers_without_reasoning"] == 1
    assert [a["reasoning_field"] for a in result["answers"]] == ["none", "reasoning", "reasoning"]
    assert result["reasoning_preview"].strip()  # shows an answer that has reasoning
    assert "1 of 3 answers have no reasoning" in caplog.text


def test_every_answer_without_reasoning_fails():
    prompts = [user("What is 2 + 2? /no_think"), user("Sort 3, 1, 2. /no_think")]
    with (
        running_server(model_name=MODEL, echo=True) as url,
        pytest.raises(ProbeError, match="reasoning is empty in every field of all 2 probe answers"),
    ):
        probe_endpoint(Endpoint(url=url), MODEL, prompts=prompts)


def test_a_run_asked_with_thinking_off_is_not_refused_for_answers_without_reasoning():
    """Answers without reasoning are what a run with the switch off asks for (it trains a drafter
    for serving with thinking off); with the switch on, the same answers still fail."""
    prompts = [user("What is 2 + 2?"), user("Sort 3, 1, 2.")]
    with running_server(model_name=MODEL, echo=True) as url:
        off = {"enable_thinking": False}
        result = probe_endpoint(Endpoint(url=url), MODEL, prompts=prompts, chat_template_kwargs=off)
        no_think = [user("What is 2 + 2? /no_think")]
        with pytest.raises(ProbeError, match="reasoning is empty in every field"):
            on = {"enable_thinking": True}
            probe_endpoint(Endpoint(url=url), MODEL, prompts=no_think, chat_template_kwargs=on)
    assert result["reasoning_field"] == "none" and result["thinking_switch"] is False
    assert result["answers_without_reasoning"] == 2 and result["content_preview"].strip()


def test_probe_sends_the_runs_own_first_prompts(tmp_path):
    import polars as pl

    from eaglenest.stages.probe import probe_prompts

    frame = pl.DataFrame({"messages": [user(f"q{i}") for i in range(5)]})
    frame.write_parquet(tmp_path / "all.parquet")
    assert probe_prompts(tmp_path / "all.parquet", 2, None) == [user("q0"), user("q1")]
    assert probe_prompts(tmp_path / "all.parquet", 1, "fixed?") == [user("q0"), user("fixed?")]
    with pytest.raises(ProbeError, match="nothing to send"):
        probe_prompts(tmp_path / "all.parquet", 0, None)


def serve_once(handler):
    """An independent aiohttp server on 127.0.0.1 in a thread: (url, stop)."""
    import asyncio
    import threading

    from aiohttp import web

    ready, box = threading.Event(), {}

    def main():
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        box["loop"] = loop
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    ready.wait(10)

    def stop():
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        thread.join(10)

    return box["url"], stop


def test_a_non_json_model_list_is_a_clear_error():
    from aiohttp import web

    async def html(request):
        return web.Response(text="<html>login</html>", content_type="text/html")

    url, stop = serve_once(html)
    try:
        with pytest.raises(ProbeError, match=r"/v1/models did not answer an OpenAI model list"):
            probe_endpoint(Endpoint(url=url), MODEL)
    finally:
        stop()


def test_an_answer_from_another_model_fails_the_probe():
    from aiohttp import web

    from eaglenest.demo.echo_backend import EchoBackend
    from eaglenest.demo.protocol import build_response, parse_chat_request

    async def handler(request):
        if request.path.endswith("/models"):
            return web.json_response({"data": [{"id": MODEL}]})
        completion = await EchoBackend().complete(parse_chat_request(await request.json()))
        return web.json_response(
            build_response(completion, model_name="other", dialect="vllm", return_token_ids=True)
        )

    url, stop = serve_once(handler)
    try:
        with pytest.raises(ProbeError, match="with model 'other'"):
            probe_endpoint(Endpoint(url=url), MODEL)
    finally:
        stop()


def test_malformed_token_ids_are_no_support():
    """A server whose ids are not integers (the `bad_token_ids` fault): the probe says so, and
    fails when ids are required, instead of validation dropping every row later."""
    with running_server(model_name=MODEL, echo=True, faults={"bad_token_ids": 1.0}) as url:
        result = probe_endpoint(Endpoint(url=url), MODEL)
        assert not result["token_ids"]["supported"]
        assert "not an integer" in result["answers"][0]["token_ids"]["problem"]
        with pytest.raises(ProbeError, match="malformed token ids"):
            probe_endpoint(Endpoint(url=url), MODEL, require_token_ids=True)
