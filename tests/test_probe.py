"""The probe against the real embedded server on 127.0.0.1: it passes on every dialect and fails in
seconds, with a message that says what to fix, on the failures that cost real runs days."""

import json
import socket
import subprocess
import sys
import time

import pytest

from eaglenest.endpoints import Endpoint
from eaglenest.probe import ProbeError, probe_endpoint, think_token_ids
from eaglenest.server_process import running_server

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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
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
