"""A streamed answer costs linear time in its chunks (vLLM sends one token a chunk)."""

from __future__ import annotations

import json
import time


def test_a_streamed_answer_costs_linear_time_in_its_chunks():
    """vLLM sends one token per chunk: the last chunks of a 64K-token answer must cost what its
    first ones do (a list rebuilt per chunk makes them ~30x dearer here)."""
    from eaglenest.client.streaming import StreamAssembler

    lines = [
        "data: "
        + json.dumps({"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [i]}]})
        for i in range(64_000)
    ]
    best_ratio = float("inf")
    for _ in range(3):
        assembler = StreamAssembler()
        started = time.perf_counter()
        for line in lines[:2_000]:
            assembler.feed_line(line)
        first_s = time.perf_counter() - started
        for line in lines[2_000:-2_000]:
            assembler.feed_line(line)
        started = time.perf_counter()
        for line in lines[-2_000:]:
            assembler.feed_line(line)
        best_ratio = min(best_ratio, (time.perf_counter() - started) / first_s)
    assert assembler.token_ids == list(range(64_000))
    assert best_ratio < 3, f"the last 2,000 chunks cost {best_ratio:.1f}x the first 2,000"
