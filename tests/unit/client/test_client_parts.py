"""The client's parts without a server: request slots shared by processes (real lock files, real
processes, a real kill -9), and the assembly of a streamed answer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eaglenest.client.pool import parse_server_gauges
from eaglenest.client.slots import EndpointSlots
from eaglenest.client.streaming import StreamAssembler, StreamError

URL = "http://127.0.0.1:9"

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from eaglenest.client.slots import EndpointSlots
    slots = EndpointSlots(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
    held = [slots.try_acquire() for _ in range(int(sys.argv[4]))]
    slots.set_waiting(len(sys.argv) > 5)  # as a job whose requests wait for a slot
    print(sum(h is not None for h in held), flush=True)
    time.sleep(60)
    """
)


def hold(
    slots_dir: Path, cap: int, wanted: int, waiting: bool = False
) -> tuple[subprocess.Popen, int]:
    """A process that takes up to `wanted` slots and keeps them (and says it waits for more);
    (process, how many it got)."""
    waits = ["waiting"] if waiting else []
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, URL, str(cap), str(slots_dir), str(wanted), *waits],
        stdout=subprocess.PIPE,
        text=True,
    )
    return process, int(process.stdout.readline())


def test_slots_are_one_cap_over_processes_and_a_kill_frees_them(tmp_path: Path):
    first, got_first = hold(tmp_path, cap=5, wanted=3)
    second, got_second = hold(tmp_path, cap=5, wanted=3)
    try:
        assert (got_first, got_second) == (3, 2)
        here = EndpointSlots(URL, 5, tmp_path)
        assert here.try_acquire() is None
        assert here.in_use() == 5
        os.kill(first.pid, signal.SIGKILL)  # no cleanup runs: the kernel drops its locks
        first.wait()
        taken = [here.try_acquire() for _ in range(4)]
        assert sorted(t is not None for t in taken) == [False, True, True, True]
        assert here.in_use() == 5
        here.release(taken[0])
        assert here.in_use() == 4
        here.close()
    finally:
        for process in (first, second):
            process.kill()
            process.wait()


def test_a_younger_process_leaves_free_slots_to_an_older_one_that_waits(tmp_path: Path):
    older, got = hold(tmp_path, cap=4, wanted=1, waiting=True)
    younger = EndpointSlots(URL, 4, tmp_path)
    try:
        assert got == 1 and younger.older_waiting()
        assert younger.try_acquire() is None, "3 slots are free, but the older job waits"
        older.kill()
        older.wait()
        assert not younger.older_waiting() and younger.try_acquire() is not None
    finally:
        older.kill()
        older.wait()


def test_each_endpoint_has_its_own_slots(tmp_path: Path):
    one, other = EndpointSlots(URL, 1, tmp_path), EndpointSlots(URL + "0", 1, tmp_path)
    assert one.try_acquire() == 0 and other.try_acquire() == 0
    assert one.try_acquire() is None
    assert one.path != other.path and one.path.with_suffix(".url").read_text() == URL + "\n"


def vllm_stream() -> list[str]:
    """A stream in vLLM's shape (first chunk with the prompt ids, reasoning then content deltas
    with their token ids, the finish reason, the usage chunk, [DONE])."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(delta: dict, ids: list[int] | None = None, finish: str | None = None, **top) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if ids is not None:
            choice["token_ids"] = ids
        return "data: " + json.dumps({**head, "choices": [choice], **top})

    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    return [
        chunk({"role": "assistant", "content": ""}, prompt_token_ids=[1, 2, 3]),
        "",
        chunk({"reasoning": "let me "}, [10]),
        chunk({"reasoning": "think"}, [11]),
        ": a comment line",
        chunk({"content": "42"}, [12]),
        chunk({}, [13], finish="stop"),
        "data: " + json.dumps({**head, "choices": [], "usage": usage}),
        "data: [DONE]",
    ]


def test_a_vllm_stream_assembles_into_the_plain_body():
    assembler = StreamAssembler()
    for line in vllm_stream():
        assembler.feed_line(line)
    body = assembler.response()
    assert assembler.done and assembler.complete
    assert body["prompt_token_ids"] == [1, 2, 3]
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "42", "reasoning": "let me think"}
    assert (choice["token_ids"], choice["finish_reason"]) == ([10, 11, 12, 13], "stop")
    assert body["usage"]["completion_tokens"] == 4 and body["model"] == "m"


def test_a_stream_that_reports_an_error_or_breaks_is_an_error():
    assembler = StreamAssembler()
    assembler.feed_line(vllm_stream()[0])
    with pytest.raises(StreamError) as error:
        assembler.feed_line('data: {"error": {"message": "engine dead", "code": 500}}')
    assert error.value.kind == "stream_error" and "engine dead" in str(error.value)
    with pytest.raises(StreamError) as error:
        StreamAssembler().feed_line("data: {not json")
    assert error.value.kind == "malformed_json"
    cut = StreamAssembler()
    for line in vllm_stream()[:4]:
        cut.feed_line(line)
    assert not cut.complete


def test_server_gauges_are_read_from_vllm_and_sglang_metrics():
    vllm = textwrap.dedent(
        """
        # HELP vllm:num_requests_running Number of requests in model execution batches.
        vllm:num_requests_running{engine="0",model_name="m"} 100.0
        vllm:num_requests_running{engine="1",model_name="m"} 28.0
        vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
        """
    )
    assert parse_server_gauges(vllm) == {"running": 128.0, "waiting": 7.0}
    sglang = 'sglang:num_running_reqs{model_name="m"} 64\nsglang:num_queue_reqs{model_name="m"} 3\n'
    assert parse_server_gauges(sglang) == {"running": 64.0, "waiting": 3.0}
    assert parse_server_gauges("process_cpu_seconds_total 12.5\n") is None
