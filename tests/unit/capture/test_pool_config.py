"""The parts of the capture pool (`vllm.capture_urls`) that need no vLLM: the one URL of
`capture_url` and the list are one pool; `serve-capture` on a node finds its own URL among
several; and a pool none of whose servers answers waits `capture_wait_s`, no longer, then fails
naming every URL (real sockets on 127.0.0.1 that nothing listens on)."""

from __future__ import annotations

import asyncio
import time

import pytest
from support.servers import free_port

from eaglenest.capture.pool import CapturePool, CaptureServerError
from eaglenest.capture.server import server_address
from eaglenest.common.config import settings_from_sections
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.vllm_engine.process import EngineError


def runtime(**vllm) -> VllmRuntime:
    return settings_from_sections(VllmRuntime, vllm=vllm)


def test_capture_url_and_capture_urls_are_one_list():
    assert runtime().capture_urls == ()
    assert runtime(capture_url="http://a:1").capture_urls == ("http://a:1",)
    both = runtime(capture_urls=["http://b:2/", "http://a:1"], capture_url="http://a:1/")
    assert both.capture_urls == ("http://b:2", "http://a:1")
    assert VllmRuntime.from_json(both.to_json()) == both


def test_serve_capture_takes_this_nodes_url_of_several():
    config = {"vllm": {"capture_url": None,
                       "capture_urls": ["http://127.0.0.1:8001", "http://127.0.0.1:8002",
                                        "http://far-away-node:8765"]}}  # fmt: skip
    assert server_address(config, None, 8002) == ("127.0.0.1", 8002)
    assert server_address(config, "0.0.0.0", 8001) == ("0.0.0.0", 8001)
    with pytest.raises(EngineError, match="2 of the 3 URLs .* pass --host and --port"):
        server_address(config, None, None)
    config["vllm"]["capture_urls"] = ["http://far-away-node:8765"]
    assert server_address(config, None, None) == ("far-away-node", 8765)


def test_a_pool_where_no_server_answers_waits_its_time_then_names_every_url():
    import numpy as np

    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    async def capture() -> None:
        pool = CapturePool(urls, "eaglenest-capture-x", cap=1, wait_s=1.0)
        async with pool:
            await pool.capture(np.arange(4), "eaglenest-test-0", 0, lambda _path: None)

    started = time.monotonic()
    with pytest.raises(CaptureServerError, match="no capture server answers") as failure:
        asyncio.run(capture())
    waited = time.monotonic() - started
    assert all(url in str(failure.value) for url in urls)
    assert "vllm.capture_wait_s" in str(failure.value)
    assert 1.0 <= waited < 10, waited


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("vllm", "capture_moves_max", 10**9),
        ("vllm", "capture_wait_s", 1e300),
        ("vllm", "capture_request_timeout_s", 1e300),
        ("vllm", "capture_lock_wait_s", 1e300),
        ("vllm", "requests_per_batch", 10**9),
        ("generation", "max_attempts", 10**9),
        ("generation", "backoff_max_s", 1e300),
        ("generation", "retry_after_max_s", 1e300),
        ("generation", "bench_s", 1e300),
    ],
)
def test_every_bound_of_the_pool_and_of_the_retries_is_bounded_above(section, key, value):
    """A bound without a maximum (capture_moves_max, max_attempts) let a wait or a count run
    for ever (or overflow); each is refused at config time, naming the key."""
    from eaglenest.common.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=rf"{section}\.{key}"):
        validate_config({section: {key: value}})
