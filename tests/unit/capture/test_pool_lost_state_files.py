"""A capture server that answers and then ends before its state file is whole has dropped the
sample: the pool sends it to another server, and the job goes on (the race the two-server kill
test can only hit by chance). Real aiohttp servers on 127.0.0.1 answer as vLLM's capture servers
do: the name on /v1/models, and a completion whose kv_transfer_params names a state file with a
`.lock` beside it that the writer no longer holds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web
from safetensors.torch import save_file
from support.servers import free_port

from eaglenest.capture import pool as capture_pool
from eaglenest.capture.pool import MOVES_MAX, CapturePool, CaptureServerError
from eaglenest.capture.state_file import read_request_file

MODEL = "eaglenest-capture-test"
PROMPT = np.arange(5, dtype=np.int64)


def whole(path: Path) -> None:
    save_file({"hidden_states": torch.ones(5, 4, 2), "token_ids": torch.from_numpy(PROMPT)}, path)


def torn(path: Path) -> None:
    whole(path)
    path.write_bytes(path.read_bytes()[:-7])  # the writer killed in the middle of the write


def missing(path: Path) -> None:
    """The writer killed between its answer and its write: the lock is left, free, no file."""


def capture_server(storage: Path, name: str, write) -> web.Application:
    sent = []

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL}]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        sent.append(body["request_id"])
        path = storage / f"cmpl-{name}-{len(sent)}.safetensors"
        Path(f"{path}.lock").touch()
        write(path)
        answer = {"choices": [{"prompt_token_ids": body["prompt"]}],
                  "kv_transfer_params": {"hidden_states_path": str(path)}}  # fmt: skip
        return web.json_response(answer)

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
    app["sent"] = sent
    return app


async def serve(apps: list[web.Application]) -> tuple[list[web.AppRunner], list[str]]:
    runners, urls = [], []
    for app in apps:
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    return runners, urls


def read_ids(path: str) -> list[int]:
    return read_request_file(path)["token_ids"].tolist()


@pytest.mark.parametrize("lost", [missing, torn], ids=["missing", "torn"])
def test_a_state_file_lost_after_the_answer_sends_the_sample_to_another_server(tmp_path, lost):
    apps = [capture_server(tmp_path, "first", lost), capture_server(tmp_path, "second", whole)]

    async def capture():
        runners, urls = await serve(apps)
        try:
            async with CapturePool(urls, MODEL, cap=1, wait_s=5.0, slots_dir=tmp_path) as pool:
                ids = await pool.capture(PROMPT, "eaglenest-test-0", 0, read_ids)
                return ids, [(s.answered, s.moved) for s in pool.servers], pool.summary()
        finally:
            for runner in runners:
                await runner.cleanup()

    ids, counts, summary = asyncio.run(capture())
    assert ids == PROMPT.tolist()
    assert counts == [(0, 1), (1, 0)], summary  # asked first (least loaded, listed first), lost
    assert [len(app["sent"]) for app in apps] == [1, 1]
    assert sorted(p.name for p in tmp_path.glob("cmpl-*")) == []  # files and locks removed


def test_a_sample_lost_by_every_server_fails_the_job_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(capture_pool, "PROBE_S", 0.05)  # the lone server set aside comes back
    app = capture_server(tmp_path, "only", missing)

    async def capture():
        runners, urls = await serve([app])
        try:
            async with CapturePool(urls, MODEL, cap=1, wait_s=30.0, slots_dir=tmp_path) as pool:
                await pool.capture(PROMPT, "eaglenest-test-0", 3, read_ids)
        finally:
            for runner in runners:
                await runner.cleanup()

    with pytest.raises(CaptureServerError, match="sample row 3: sent 10 times") as failure:
        asyncio.run(capture())
    assert "state file is missing or torn" in str(failure.value)
    assert len(app["sent"]) == MOVES_MAX == 10
    assert json.dumps(sorted(p.name for p in tmp_path.glob("cmpl-*"))) == "[]"
