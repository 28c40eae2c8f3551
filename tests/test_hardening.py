"""Issue 30, one test per item (test_NN_ is the item's number): no single bad answer kills a job,
no signal leaves a process or a file behind, the endpoint cap holds on shared hosts.

Real parts throughout: aiohttp servers on 127.0.0.1 that answer what a broken server or proxy
answers, real processes killed with real signals, real lock files. Names new in the fix are
imported inside the tests, so that on the code before it each test fails on its own."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import polars as pl
import pytest
import torch
from aiohttp import web
from support.frames import prompt_frame
from support.generation import MODEL, fast_settings, shard_settings

from eaglenest.client.endpoints import Endpoint
from eaglenest.common.config import ConfigError, validate_config
from eaglenest.common.io import write_json
from eaglenest.demo.echo_backend import EchoBackend
from eaglenest.demo.protocol import build_response, parse_chat_request
from eaglenest.demo.server_process import running_server
from eaglenest.formats.raw import RawSchema, write_raw
from eaglenest.stages.generate.generate import generate_records, generate_shard
from eaglenest.stages.generate.request import record_from_response, request_body

SRC = Path(__file__).resolve().parents[1] / "src"


@contextlib.asynccontextmanager
async def serving(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """An HTTP server on 127.0.0.1 whose chat completions `handler` answers; yields its URL."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def echo_answer(body: dict) -> dict:
    """What the demo's echo server answers (vLLM's dialect, with token ids)."""
    completion = await EchoBackend().complete(parse_chat_request(body))
    return build_response(completion, model_name=MODEL, dialect="vllm", return_token_ids=True)


def last_user_text(body: dict) -> str:
    return body["messages"][-1]["content"]


def events(*chunks: bytes) -> bytes:
    return b"".join(b"data: " + chunk + b"\n\n" for chunk in chunks)


async def send_events(request: web.Request, payload: bytes) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(payload)
    await response.write_eof()
    return response


# --- 1: a malformed 200 answer is a retry, then a failure row -----------------------------------

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
def test_01_a_malformed_answer_is_retried_then_a_failure_row_never_a_dead_job(tmp_path, case):
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


# --- 2: a lone surrogate never reaches the journal, and an old journal's is asked again ---------


def test_02_a_lone_surrogate_is_retried_and_a_poisoned_journal_record_is_asked_again(tmp_path):
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


# --- 3: streaming costs linear time per answer --------------------------------------------------


def test_03_a_streamed_answer_costs_linear_time_in_its_chunks():
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


# --- 4: the wait for an endpoint slot is not latency ---------------------------------------------


def test_04_latency_excludes_the_wait_for_a_slot_which_is_recorded_apart(tmp_path):
    """Cap 1, four prompts at once, 0.5 s each: they queue for the one slot."""
    prompts = prompt_frame(4).to_dicts()
    settings = fast_settings(timeout_s=10.0, slots_dir=str(tmp_path / "slots"))
    with running_server(model_name=MODEL, echo=True, echo_latency_s=0.5) as url:
        records = asyncio.run(
            generate_records(
                prompts, [Endpoint(url, max_concurrency=1)], settings, tmp_path / "j.jsonl"
            )
        )
    assert all(0.45 <= r["latency_s"] < 1.0 for r in records.values()), records
    waits = sorted(r["slot_wait_s"] for r in records.values())
    assert waits[0] < 0.3 and waits[-1] >= 1.3, waits  # the last one waited for three others


# --- 5: the slot directory is the job's own --------------------------------------------------


def test_05_the_slot_directory_is_owned_private_and_its_links_are_not_followed(
    tmp_path, monkeypatch
):
    from eaglenest.client.slots import EndpointSlots, SlotLockError, default_slots_dir, slot_file

    runtime_dir = tmp_path / "run-user"
    runtime_dir.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime_dir))
    directory = default_slots_dir()
    assert directory.parent == runtime_dir
    EndpointSlots("http://h:1", 2).close()
    assert directory.stat().st_mode & 0o777 == 0o700

    # Another user's planted link: the job must not write through it.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    label = slot_file(directory, "http://h:2").with_suffix(".url")
    label.symlink_to(victim)
    with pytest.raises(SlotLockError, match="link"):
        EndpointSlots("http://h:2", 2)
    assert victim.read_text() == "precious\n"

    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(SlotLockError, match="written by others"):
        EndpointSlots("http://h:3", 2, open_to_all)
    if os.getuid() == 0:  # as root the test can make a directory another user owns
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(SlotLockError, match="owned by uid 65534"):
            EndpointSlots("http://h:4", 2, theirs)


# --- 6: an endpoint listed twice is a config error ----------------------------------------------


def test_06_the_same_endpoint_listed_twice_is_a_config_error(tmp_path):
    from eaglenest.client.pool import EndpointPool

    twice = [{"url": "http://h:8000"}, {"url": "HTTP://H:8000/v1/"}]
    with pytest.raises(ConfigError, match=r"entries 0 .* and 1 .* are the same endpoint"):
        validate_config({"endpoints": twice})
    assert validate_config({"endpoints": [{"url": "http://h:8000"}, {"url": "http://h:8001"}]})

    async def pool():
        EndpointPool([Endpoint("http://h:80"), Endpoint("http://h/v1")], 3, 1.0, tmp_path)

    with pytest.raises(ValueError, match="same endpoint"):
        asyncio.run(pool())


# --- 7: deference to an older waiter is bounded; benched endpoints are not waited on ------------

OLDER_WAITER = """
import os, signal, sys
from pathlib import Path
from eaglenest.client.slots import EndpointSlots
slots = EndpointSlots("http://h:7", 2, Path(sys.argv[1]))
slots.set_waiting(True)
print("waiting", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # Ctrl-Z, a suspended SLURM job
"""


def test_07_a_stopped_older_waiter_holds_younger_jobs_back_only_for_a_while(tmp_path, monkeypatch):
    import eaglenest.client.slots as slots_module

    monkeypatch.setattr(slots_module, "DEFER_MAX_S", 0.5, raising=False)
    older = subprocess.Popen(
        [sys.executable, "-c", OLDER_WAITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    try:
        assert older.stdout.readline() == "waiting\n"
        younger = slots_module.EndpointSlots("http://h:7", 2, tmp_path)
        assert younger.older_waiting()
        deadline = time.monotonic() + 5
        got = None
        while got is None and time.monotonic() < deadline:
            got = younger.try_acquire()
            time.sleep(0.05)
        assert got is not None, "a stopped older waiter stalled the younger job"
        younger.close()
    finally:
        older.kill()
        older.wait()


def test_07_a_job_marks_itself_waiting_only_where_it_would_take_a_slot(tmp_path):
    from eaglenest.client.pool import EndpointPool

    async def scenario():
        pool = EndpointPool(
            [Endpoint("http://a:1", max_concurrency=1), Endpoint("http://b:1", max_concurrency=1)],
            3,
            60.0,
            tmp_path,
        )
        first = await pool.acquire()
        other = pool.states[1] if first.state is pool.states[0] else pool.states[0]
        other.benched_until = time.monotonic() + 60  # the other endpoint is benched
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0.1)  # waits: the healthy endpoint's one slot is taken
        marks = (first.state.slots.waiting, other.slots.waiting)
        pool.release(first, ok=True)
        pool.release(await waiter, ok=True)
        pool.close()
        return marks

    assert asyncio.run(scenario()) == (True, False)


# --- 8: only "held" counts as held ----------------------------------------------------------


def test_08_a_lock_error_other_than_held_is_raised_not_retried_forever(tmp_path):
    from eaglenest.client.slots import EndpointSlots, SlotLockError

    slots = EndpointSlots("http://h:8", 2, tmp_path)
    os.close(slots._fd)
    # A descriptor the kernel refuses write locks on (EBADF), as NFS may refuse with ENOLCK/EIO.
    slots._fd = os.open(slots.path, os.O_RDONLY)
    with pytest.raises(SlotLockError, match=r"\.lock.*http://h:8"):
        slots.try_acquire()
    slots.close()


# --- 9: SIGTERM runs `finally`; engine children die with their parent; stale temps go ----------

JOB = """
import sys, time
from pathlib import Path
from eaglenest.vllm_engine.process import engine_process
from eaglenest.common.io import atomic_path
from eaglenest.common.logs import log_to

out = Path(sys.argv[1])
with log_to(out.with_suffix(".log")):
    with atomic_path(out) as tmp, engine_process(
        sys.executable, "timeit", ["-n", "1", "-r", "1", "import time; time.sleep(120)"], {}
    ) as engine:
        tmp.write_text("half")
        print(engine.pid, flush=True)
        time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def start_job(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, str(tmp_path / "out.json")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    engine_pid = int(job.stdout.readline())
    assert alive(engine_pid)
    return job, engine_pid


def wait_dead(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_09_no_signal_leaves_an_engine_or_a_temp_file_behind(tmp_path, sig):
    job, engine_pid = start_job(tmp_path)
    try:
        job.send_signal(sig)
        job.wait(60)
        assert wait_dead(engine_pid, 10), f"the engine outlived its job ({sig.name})"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine_pid, signal.SIGKILL)
        job.kill()
    temps = list(tmp_path.glob(".out.json.*.tmp"))
    if sig == signal.SIGTERM:  # handled like SIGINT: `finally` removed the temp file
        assert temps == [] and "KeyboardInterrupt" in (tmp_path / "out.log").read_text()
    else:  # nothing runs after SIGKILL: the next write of the output removes it
        assert len(temps) == 1
        write_json(tmp_path / "out.json", {"ok": True})
        assert list(tmp_path.glob(".out.json.*.tmp")) == []


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_09_stale_temp_siblings_are_removed_and_a_live_writers_kept(tmp_path):
    out = tmp_path / "out.json"
    stale = tmp_path / ".out.json.deadbeef.tmp"
    stale.write_bytes(b"\0" * 1000)
    stale_dir = tmp_path / ".out.json.0000ffff.tmp"
    stale_dir.mkdir()
    live = tmp_path / ".out.json.0badcafe.tmp"
    live.write_text("being written")
    unrelated = tmp_path / ".other.json.deadbeef.tmp"
    unrelated.write_text("x")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(live)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        write_json(out, {"ok": True})
    finally:
        holder.kill()
        holder.wait()
    assert not stale.exists() and not stale_dir.exists()
    assert live.exists() and unrelated.exists()
    assert json.loads(out.read_text()) == {"ok": True}


# --- 10: engine messages survive a worker writing to the same pipe -----------------------------


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_10_an_engine_message_is_one_write_and_is_found_after_a_workers_partial_line():
    from eaglenest.vllm_engine.process import MARKER, engine_messages, say

    stream = CountingStream()
    with contextlib.redirect_stdout(stream):
        say({"index": 3, "path": "/x"})
    assert stream.writes == 1 and stream.getvalue() == MARKER + '{"index": 3, "path": "/x"}\n'

    child = textwrap.dedent(
        """
        import sys
        from eaglenest.vllm_engine.process import say
        sys.stdout.write("INFO worker: half a line ")  # a worker's line, cut by our message
        sys.stdout.flush()
        say({"done": True})
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", child],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    messages = list(engine_messages(process, []))
    process.wait()
    assert messages == [{"done": True}]


# --- 11: a torn line of metrics.jsonl never stops a resume ---------------------------------------


def test_11_a_torn_metrics_line_is_dropped_on_resume(tmp_path):
    from eaglenest.stages.train.checkpoint import MetricsLog

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"split": "train", "step": s, "loss": 1.0}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"split": "train", "step": 4, "lo')
    metrics = MetricsLog(path, keep_until_step=2)
    metrics.write({"split": "train", "step": 3, "loss": 0.5})
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert list(tmp_path.glob(".metrics.jsonl.*.tmp")) == []


# --- 12: rows stay inside their tensors; offsets agree with shapes; tokens are the ones used ----


def small_shard(tmp_path: Path, offsets: list[int], n_tokens: int = 5) -> Path:
    from eaglenest.common.config import settings_from_sections
    from eaglenest.common.io import sha256_file
    from eaglenest.formats.hidden_shard import FORMAT, create_hidden_shard, tensor_specs
    from eaglenest.settings.hidden_states import HiddenSettings

    settings = settings_from_sections(HiddenSettings, hidden={"dtype": "fp32"})
    tokens = tmp_path / "tokens.parquet"
    pl.DataFrame({"id": ["a", "b"]}).write_parquet(tokens)
    specs = tensor_specs(len(offsets) - 1, n_tokens, 4, 3, settings)
    metadata = {
        "format": FORMAT,
        "aux_layer_ids": "[1, 2, 3]",
        "hidden_size": "4",
        "dtype": "fp32",
        "target_signal": "final_hidden",
        "sample_ids": json.dumps([f"s{i}" for i in range(len(offsets) - 1)]),
        "tokens_sha256": sha256_file(tokens),
    }
    out = tmp_path / f"h{'_'.join(map(str, offsets))}.safetensors"
    with create_hidden_shard(out, specs, metadata, settings, 3) as writer:
        writer.write("offsets", 0, torch.tensor(offsets, dtype=torch.int64))
        with pytest.raises(ValueError, match=r"input_ids: rows 4:7 .* do not fit its 5 rows"):
            writer.write("input_ids", 4, torch.zeros(3, dtype=torch.int64))
    return out


def test_12_shard_rows_offsets_and_tokens_are_checked(tmp_path):
    from eaglenest.formats.hidden_shard import open_hidden_shard
    from eaglenest.stages.hidden_states.vllm_backend import pack_request
    from eaglenest.vllm_engine.capture_request import VllmCaptureError

    good = small_shard(tmp_path, [0, 2, 5])
    assert len(open_hidden_shard(good, expect_tokens=tmp_path / "tokens.parquet")) == 2
    other_tokens = tmp_path / "other.parquet"
    pl.DataFrame({"id": ["c"]}).write_parquet(other_tokens)
    with pytest.raises(ValueError, match="tokens_sha256"):
        open_hidden_shard(good, expect_tokens=other_tokens)
    with pytest.raises(ValueError, match=r"field offsets: end at 7, but \w+ has 5 rows"):
        open_hidden_shard(small_shard(tmp_path, [0, 2, 7]))
    with pytest.raises(ValueError, match="field offsets: decrease"):
        open_hidden_shard(small_shard(tmp_path, [0, 4, 3, 5]))

    # vLLM's state file with fewer rows than the tokens it names.
    frame = pl.DataFrame({"id": ["s0"], "input_ids": [[5, 6, 7]], "prompt_len": [1]})
    states = {"token_ids": torch.tensor([5, 6, 7]), "hidden_states": torch.zeros(2, 4, 4)}
    with pytest.raises(VllmCaptureError, match="2 rows for 3 tokens"):
        pack_request(None, frame, 0, [0, 3], states, None, Path("tokens/00000.parquet"))


# --- 13: credentials in an endpoint URL reach no file -------------------------------------------


def test_13_credentials_in_an_endpoint_url_reach_no_log_row_or_file(tmp_path, monkeypatch):
    from eaglenest.common.logs import log_to

    password, key = "s3cretpw-eaglenest", "k3yvalue-eaglenest"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the default slot dir, inside tmp_path
    prompts_path = tmp_path / "prompts.parquet"
    prompt_frame(6).write_parquet(prompts_path)
    probe = tmp_path / "probe.json"
    write_json(probe, {"token_ids": {"supported": True}})
    with running_server(model_name=MODEL, echo=True, faults={"error_500": 0.3}) as url:
        with_credentials = url.replace("http://", f"http://user:{password}@") + f"/v1?key={key}"
        config = validate_config(
            {
                "target": {"model": MODEL},
                "endpoints": [{"url": with_credentials}],
                "generation": {"backoff_base_s": 0.01, "activity_s": 0.1},
            }
        )
        with log_to(tmp_path / "generate.log"):
            result = generate_shard(
                prompts_path,
                probe,
                tmp_path / "raw.parquet",
                *shard_settings(config),
                tmp_path / "journal.jsonl",
                shard="00000",
                activity=tmp_path / "activity.json",
            )
    assert result == {"prompts": 6, "errors": 0}
    raw = pl.read_parquet(tmp_path / "raw.parquet")
    assert set(raw["endpoint"]) == {
        url.replace("http://", "http://<redacted>@") + "?key=<redacted>"
    }
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".url" for p in files)  # the slot directory was looked at too
    for path in files:
        data = path.read_bytes()
        assert password.encode() not in data and key.encode() not in data, path


# --- 14: a run name stays inside results/ -------------------------------------------------------


@pytest.mark.parametrize("run", ["..", ".", ".hidden", "a/b"])
def test_14_a_run_name_that_leaves_results_is_refused(run):
    with pytest.raises(ConfigError, match="run"):
        validate_config({"run": run})
    assert validate_config({"run": "my-run.v2"})["run"] == "my-run.v2"


# --- 15: a byte that is not UTF-8 is named by line; bodies are read with a cap -------------------


def test_15_a_prompts_line_that_is_not_utf8_is_counted_with_its_line_number(tmp_path):
    from eaglenest.stages.prompts.prompts import prepare_prompts
    from eaglenest.stages.prompts.sources import PromptSourceError

    jsonl = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"question {i}"}).encode() for i in range(4)]
    lines[2] = b'{"prompt": "caf\xe9"}'  # Latin-1, not UTF-8
    jsonl.write_bytes(b"\n".join(lines) + b"\n")
    config = validate_config(
        {"seed": 0, "prompts": {"source": str(jsonl), "shuffle": False, "max_samples": 3}}
    )
    report = prepare_prompts(config, tmp_path / "all.parquet", tmp_path / "report.json")
    assert report["skipped"]["invalid_json"] == 1
    (example,) = report["skipped_examples"]["invalid_json"]
    assert "line 3: not UTF-8" in example
    whole = tmp_path / "prompts.json"
    whole.write_bytes(b'[\n{"prompt": "a"},\n{"prompt": "caf\xe9"}\n]\n')
    config = validate_config({"seed": 0, "prompts": {"source": str(whole)}})
    with pytest.raises(PromptSourceError, match=r"prompts\.json: line 3: not UTF-8"):
        prepare_prompts(config, tmp_path / "all2.parquet", tmp_path / "report2.json")


def test_15_endless_and_oversized_bodies_are_read_with_a_cap(tmp_path, monkeypatch):
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


# --- 16: the engine's acceptance and ours on one definition -------------------------------------


def test_16_engine_and_live_acceptance_are_reported_on_one_definition():
    """The figures of the issue: 16 prompts, 654 tokens, 210 rounds in both; vLLM's counters say
    3.167, our loop 3.105. Emitted tokens per round: (654 - 16) / 210 in both."""
    from eaglenest.stages.evaluate.evaluate import emitted_per_round, live_vs_engine
    from eaglenest.stages.report.acceptance import engine_table

    engine_k = {"acceptance_length": 3.167, "rounds": 210, "tokens": 654, "prompts": 16}
    live_k = {"acceptance_length": 3.105, "rounds": 210, "tokens": 654, "prompts": 16}
    assert emitted_per_round(654, 16, 210) == pytest.approx(638 / 210)
    engine_k["emitted_per_round"] = live_k["emitted_per_round"] = emitted_per_round(654, 16, 210)
    assert live_vs_engine({"3": live_k}, {"3": engine_k}) == {"3": pytest.approx(1.0)}
    metrics = {
        "simulated": {"3": {"acceptance_length": 3.0}},
        "live": {"3": live_k},
        "engine": {"engine": "vllm", "per_k": {"3": engine_k}},
    }
    html = engine_table(metrics, ["3"])
    cells = html.split("<tbody>")[1].split("</td><td>")
    assert cells[1] == cells[2] == "3.04"  # emitted per round: vLLM, live
    assert "3.17" in cells and "3.1" in cells  # each one's own acceptance length, beside
    assert "emitted tokens per round, vllm" in html and "vllm&#x27;s own acceptance length" in html
    assert "past the end of an answer" in html
