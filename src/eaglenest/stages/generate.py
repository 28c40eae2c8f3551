"""Generation: send every prompt of a shard to the target's endpoints and keep every answer.

Three promises, each from a lesson of the original run:
- nothing is lost: every finished request (answer or terminal failure) is appended to the shard's
  journal and flushed as it completes; a rerun skips the ids already answered;
- reasoning is read from whatever field the server used (`eaglenest.client.reasoning`), and the
  field is recorded per row;
- the API key never reaches the journal, the parquet or the logs.

And the endpoints stay full: each endpoint's max_concurrency is a cap over every shard job
running at once (request slots, eaglenest.client.slots), so several shard jobs run side by side
and one's free slots serve the next one's prompts, with no idle tail between shards. Answers are
streamed where the server sends token ids in streams (eaglenest.client.chat), so a long answer
is never cut by a total timeout.

The client is asyncio + aiohttp. httpx was measured here first: one AsyncClient with 128
connections spends ~22 ms of CPU per request and 16 clients still ~2.6 ms, which caps a 2-core
client near 400 requests/s; aiohttp costs ~0.8 ms, so the client stays far from being the
bottleneck (bench/generate.py compares this client with a bare aiohttp loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import polars as pl
from tqdm import tqdm

from eaglenest.client.chat import STREAM_FIELDS, RetryableError, TerminalError, post_once
from eaglenest.client.credentials import api_key_from_env, auth_headers, redact, url_secrets
from eaglenest.client.endpoints import Endpoint, open_endpoints
from eaglenest.client.pool import EndpointPool, Slot, activity_summary, watch_activity
from eaglenest.client.reasoning import extract_reasoning
from eaglenest.client.responses import extract_token_ids
from eaglenest.common.io import read_json, write_json
from eaglenest.formats.raw import RAW_SCHEMA, checked_token_ids, write_raw
from eaglenest.settings.generate import GenerationClientSettings, RequestSettings

log = logging.getLogger(__name__)

# Fields that change how an answer travels, not what is asked: a journaled answer to a body that
# differs only in these is the answer to the current request.
TRANSPORT_FIELDS = frozenset(STREAM_FIELDS)


class GenerationError(RuntimeError):
    """Too many terminal failures in a shard; what was answered is kept in the journal."""


# The probe's token-id layouts (probe.json) of servers that send the ids in a stream too: vLLM's,
# or none at all. SGLang's does not stream them, and "mixed" endpoints may include one.
STREAMS_TOKEN_IDS = ("vllm", "None", None)


@dataclass(frozen=True)
class GenerationSettings:
    """What one shard job runs with: the request settings (the rule's rerun trigger), the client
    settings (no reason to rerun), whether to ask for token ids and whether to stream (what the
    probe found)."""

    request: RequestSettings
    client: GenerationClientSettings
    return_token_ids: bool
    stream: bool

    @classmethod
    def from_parts(
        cls,
        request: RequestSettings,
        client: GenerationClientSettings,
        return_token_ids: bool,
        layout: str | None = None,
    ) -> GenerationSettings:
        """`layout`: the token-id layout the probe found; `generation.stream: auto` streams
        unless the server would drop the ids from a stream."""
        stream = {"always": True, "never": False}.get(client.stream, layout in STREAMS_TOKEN_IDS)
        return cls(request, client, return_token_ids, stream)


def sample_seed(run_seed: int, sample_id: str) -> int:
    """Per-sample sampling seed: stable for (run seed, sample), independent of order and shard."""
    digest = hashlib.sha256(f"{run_seed}:{sample_id}".encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


def request_body(sample_id: str, messages: list[dict], settings: GenerationSettings) -> dict:
    body: dict[str, Any] = {
        "model": settings.request.target.model,
        "messages": messages,
        "temperature": settings.request.temperature,
        "top_p": settings.request.top_p,
        "max_tokens": settings.request.max_tokens,
        "seed": sample_seed(settings.request.seed, sample_id),
    }
    if settings.request.target.chat_template_kwargs:
        body["chat_template_kwargs"] = settings.request.target.chat_template_kwargs
    if settings.return_token_ids:
        body["return_token_ids"] = True
    body.update(settings.request.extra_body)
    return body


def record_from_response(
    sample_id: str,
    endpoint: str,
    body: dict,
    response: dict,
    response_text: str,
    latency_s: float,
    attempts: int,
) -> dict[str, Any]:
    choice = response["choices"][0]
    message = choice.get("message") or {}
    parts = extract_reasoning(message)
    ids = extract_token_ids(response)
    usage = response.get("usage") or {}
    record = {
        "id": sample_id,
        "endpoint": endpoint,
        "request": json.dumps(body, sort_keys=True),
        "response": response_text,  # the body exactly as the server sent it
        "reasoning": parts.reasoning,
        "content": parts.content,
        "reasoning_field": parts.field,
        "finish_reason": choice.get("finish_reason"),
        "prompt_token_ids": ids.prompt,
        "completion_token_ids": ids.completion,
        "token_layout": ids.layout,
        "token_ids_error": None,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "latency_s": round(latency_s, 4),
        "slot_wait_s": None,
        "attempts": attempts,
        "error_kind": None,
        "error": None,
    }
    return checked_token_ids(record)


def failure_record(
    sample_id: str,
    endpoint: str,
    body: dict,
    kind: str,
    error: str,
    attempts: int,
    spent: Attempt,
) -> dict[str, Any]:
    record = dict.fromkeys(RAW_SCHEMA)
    record.update(
        id=sample_id,
        endpoint=endpoint,
        request=json.dumps(body, sort_keys=True),
        reasoning_field="none",
        attempts=attempts,
        error_kind=kind,
        error=error,
        **timing(spent),
    )
    return record


# --- the shard --------------------------------------------------------------------------------


@dataclass
class Progress:
    bar: tqdm
    retries: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    in_flight: int = 0

    def update_postfix(self) -> None:
        self.bar.set_postfix(
            in_flight=self.in_flight,
            retries=sum(self.retries.values()),
            errors=sum(self.errors.values()),
            refresh=False,
        )


def _backoff_s(attempt: int, settings: GenerationSettings, server_wait_s: float | None) -> float:
    backoff = min(
        settings.client.backoff_max_s, settings.client.backoff_base_s * 2 ** (attempt - 1)
    )
    backoff *= random.uniform(0.5, 1.5)  # jitter: retries of a burst do not arrive together
    # A server's wait is honoured up to a cap: one odd header must not park a worker for hours.
    return max(backoff, min(server_wait_s or 0.0, settings.client.retry_after_max_s))


@dataclass
class Attempt:
    """What one prompt's attempts cost: the seconds spent waiting for slots, and in flight."""

    slot_wait_s: float = 0.0
    in_flight_s: float = 0.0  # of the latest attempt: the answer's latency, not its queueing


async def attempt_once(
    sample_id: str,
    attempt: int,
    slot: Slot,
    body: dict,
    session: aiohttp.ClientSession,
    headers: dict,
    settings: GenerationSettings,
) -> dict[str, Any]:
    """One request on a held slot, made a record. Anything a server's answer makes the client
    raise, beyond the two errors it sorts answers into, is a retry too: one odd answer must
    never end a job that has a week of answers in flight."""
    endpoint = slot.state.endpoint
    try:
        response, text = await post_once(
            session,
            endpoint,
            body,
            headers,
            stream=settings.stream,
            timeout_s=settings.client.timeout_s,
            idle_timeout_s=settings.client.idle_timeout_s,
        )
        return record_from_response(sample_id, endpoint.name, body, response, text, 0.0, attempt)
    except (RetryableError, TerminalError, asyncio.CancelledError):
        raise
    except Exception as err:  # the policy above
        log.warning("an answer from %s raised %r; retried", slot.state.endpoint.name, err)
        raise RetryableError("client_error", f"{type(err).__name__}: {err}"[:500]) from err


async def request_with_retries(
    sample_id: str,
    body: dict,
    pool: EndpointPool,
    session: aiohttp.ClientSession,
    headers_by_url: dict[str, dict],
    settings: GenerationSettings,
    progress: Progress,
) -> dict[str, Any]:
    """One prompt's answer or terminal failure; a slot is held only while a request is in flight
    (not while backing off), so waiting retries leave the endpoint to other requests. The row's
    `latency_s` is its answering attempt's time in flight; `slot_wait_s` the waits for slots."""
    spent = Attempt()
    last_kind, last_error, last_name = "none", "", ""
    for attempt in range(1, settings.client.max_attempts + 1):
        asked_at = time.monotonic()
        slot = await pool.acquire()
        spent.slot_wait_s += slot.acquired_at - asked_at
        url, last_name = slot.state.endpoint.url, slot.state.endpoint.name
        progress.in_flight += 1
        try:
            headers = headers_by_url[url]
            record = await attempt_once(sample_id, attempt, slot, body, session, headers, settings)
        except RetryableError as err:
            pool.release(slot, ok=False)
            last_kind, last_error = err.kind, str(err)
            progress.retries[err.kind] += 1
            if attempt < settings.client.max_attempts:
                await asyncio.sleep(_backoff_s(attempt, settings, err.retry_after_s))
            continue
        except TerminalError as err:
            pool.release(slot, ok=True)  # the endpoint answered; the request is at fault
            spent.in_flight_s = time.monotonic() - slot.acquired_at
            return failure_record(sample_id, last_name, body, err.kind, str(err), attempt, spent)
        finally:
            progress.in_flight -= 1
            spent.in_flight_s = time.monotonic() - slot.acquired_at
        pool.release(slot, ok=True)
        return record | timing(spent)
    error = f"gave up after {settings.client.max_attempts} attempts: {last_error}"
    attempts = settings.client.max_attempts
    return failure_record(sample_id, last_name, body, last_kind, error, attempts, spent)


def timing(spent: Attempt) -> dict[str, float]:
    return {
        "latency_s": round(spent.in_flight_s, 4),
        "slot_wait_s": round(spent.slot_wait_s, 4),
    }


def request_key(body: dict[str, Any]) -> str:
    """What was asked, as one string: the body less transport-only fields, sorted."""
    return json.dumps({k: v for k, v in body.items() if k not in TRANSPORT_FIELDS}, sort_keys=True)


def iter_journal(journal: Path) -> Iterator[dict[str, Any]]:
    """Every record of the journal in order; a torn line (a kill mid-write) is skipped."""
    if not journal.exists():
        return
    with journal.open() as lines:
        for line in lines:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def encodable(record: dict[str, Any]) -> bool:
    """Can the record be written as UTF-8? An answer journaled before answers were checked may
    hold a lone surrogate (valid JSON, no UTF-8): it is asked again, never reused, or it would
    fail the raw file on every rerun."""
    try:
        json.dumps(record, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def read_journal(journal: Path) -> dict[str, dict[str, Any]]:
    """The latest-asked records by id, whatever they asked; answers win over failures."""
    records: dict[str, dict[str, Any]] = {}
    for record in iter_journal(journal):
        previous = records.get(record["id"])
        if previous is None or previous["error_kind"] is not None:
            records[record["id"]] = record
    return records


@dataclass
class JournalMatch:
    """What the journal holds for the requests the current settings send."""

    reused: dict[str, dict[str, Any]]  # id -> an answer to exactly this request
    origins: dict[str, str]  # id -> why it is asked again: new, retry or settings_changed

    def counts(self) -> dict[str, int]:
        counted = Counter(self.origins.values())
        return {"journal": len(self.reused)} | {k: counted[k] for k in REASK_ORIGINS}


REASK_ORIGINS = ("new", "retry", "settings_changed")


def match_journal(journal: Path, bodies: dict[str, dict[str, Any]]) -> JournalMatch:
    """Match the journal against the request body each prompt id would be sent now.

    An answer is reused only when it answered this very request; an answer to a request that the
    settings have since changed (temperature, max_tokens, model, ...) stays in the journal but is
    asked again. A matching failure means the request is retried.
    """
    keys = {sample_id: request_key(body) for sample_id, body in bodies.items()}
    reused: dict[str, dict[str, Any]] = {}
    failed, answered_otherwise = set(), set()
    for record in iter_journal(journal):
        sample_id = record["id"]
        if sample_id not in keys or sample_id in reused:
            continue
        same_request = request_key(json.loads(record["request"])) == keys[sample_id]
        if same_request and record["error_kind"] is None and encodable(record):
            reused[sample_id] = record
        elif same_request:
            failed.add(sample_id)
        elif record["error_kind"] is None:
            answered_otherwise.add(sample_id)
    origins = {}
    for sample_id in keys.keys() - reused.keys():
        if sample_id in failed:
            origins[sample_id] = "retry"
        elif sample_id in answered_otherwise:
            origins[sample_id] = "settings_changed"
        else:
            origins[sample_id] = "new"
    return JournalMatch(reused, origins)


def _log_plan(
    shard: str,
    n_prompts: int,
    n_asked: int,
    matched: JournalMatch,
    journal: Path,
    settings: GenerationSettings,
) -> None:
    counts = matched.counts()
    if settings.stream:
        log.info(
            "streaming: a request fails after %s s without a chunk (generation.idle_timeout_s)",
            settings.client.idle_timeout_s,
        )
    elif settings.client.timeout_s is None:
        log.warning(
            "requests are not streamed (generation.stream, or a server that drops token ids from "
            "streams) and generation.timeout_s is null: nothing bounds a request that hangs"
        )
    log.info(
        "shard %s: %d prompts; %d answers reused from %s; asking %d: %d new, %d failed before, "
        "%d re-asked because the request changed (temperature, max_tokens, model, ...)",
        shard,
        n_prompts,
        counts["journal"],
        journal,
        n_asked,
        counts["new"],
        counts["retry"],
        counts["settings_changed"],
    )


def _progress(shard: str, total: int, already_done: int) -> Progress:
    bar = tqdm(
        total=total,
        initial=already_done,
        desc=f"generate {shard}",
        unit="req",
        mininterval=1.0,
        smoothing=0.1,
    )
    return Progress(bar)


@contextlib.contextmanager
def open_journal(journal: Path, shard: str) -> Iterator[TextIO]:
    """The journal, open for appending by this job alone: a job of an interrupted run that is
    still alive (an orphan of a killed Snakemake) would otherwise answer the same prompts again."""
    journal.parent.mkdir(parents=True, exist_ok=True)
    with journal.open("a") as journal_file:
        try:
            fcntl.flock(journal_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GenerationError(
                f"shard {shard}: another process is writing {journal} (a generation job of an "
                "interrupted run still alive?); stop it, then rerun: nothing answered is lost"
            ) from None
        if journal_file.tell():
            with journal.open("rb") as tail:
                tail.seek(-1, 2)
                if tail.read(1) != b"\n":
                    journal_file.write("\n")  # end the line torn by a kill so the next parses
        yield journal_file


@dataclass
class ShardRequests:
    """What the workers of one shard job share."""

    bodies: dict[str, dict[str, Any]]
    origins: dict[str, str]
    settings: GenerationSettings
    pool: EndpointPool
    headers_by_url: dict[str, dict]
    secrets: list[str | None]
    progress: Progress
    done: dict[str, dict[str, Any]]


async def _answer_all(
    todo: list[dict[str, Any]], job: ShardRequests, session: aiohttp.ClientSession, journal: TextIO
) -> None:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for prompt in todo:
        queue.put_nowait(prompt)

    async def worker() -> None:
        while not queue.empty():
            sample_id = queue.get_nowait()["id"]
            record = await request_with_retries(
                sample_id,
                job.bodies[sample_id],
                job.pool,
                session,
                job.headers_by_url,
                job.settings,
                job.progress,
            )
            record["origin"] = job.origins[sample_id]
            # Only the error can quote a secret (a proxy echoing headers); the model's text is
            # never touched, whatever the key happens to spell.
            record["error"] = redact(record["error"], job.secrets)
            journal.write(json.dumps(record, sort_keys=True) + "\n")
            journal.flush()  # on disk for the next run even if this one is killed
            job.done[sample_id] = record
            if record["error_kind"] is not None:
                job.progress.errors[record["error_kind"]] += 1
            job.progress.bar.update(1)
            job.progress.update_postfix()

    workers = min(job.settings.client.concurrency, max(1, len(todo)))
    await asyncio.gather(*(worker() for _ in range(workers)))


async def generate_records(
    prompts: list[dict[str, Any]],
    endpoints: list[Endpoint],
    settings: GenerationSettings,
    journal: Path,
    shard: str = "",
    activity: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """Answer every prompt whose current request the journal has not answered; return all
    records by id, each with its `origin` (journal, new, retry or settings_changed). Requests
    hold a slot of their endpoint's run-wide cap while in flight; `activity` receives how busy
    each endpoint was (see eaglenest.client.pool)."""
    bodies = {p["id"]: request_body(p["id"], p["messages"], settings) for p in prompts}
    matched = match_journal(journal, bodies)
    todo = [p for p in prompts if p["id"] in matched.origins]
    _log_plan(shard, len(prompts), len(todo), matched, journal, settings)
    keys = [api_key_from_env(e.api_key_env) for e in endpoints]
    secrets = [*keys, *(secret for e in endpoints for secret in url_secrets(e.url))]
    slots_dir = Path(settings.client.slots_dir) if settings.client.slots_dir else None
    job = ShardRequests(
        bodies,
        matched.origins,
        settings,
        EndpointPool(
            endpoints, settings.client.bench_after_failures, settings.client.bench_s, slots_dir
        ),
        {e.url: auth_headers(k) for e, k in zip(endpoints, keys, strict=True)},
        secrets,
        _progress(shard, len(prompts), already_done=len(prompts) - len(todo)),
        {k: v | {"origin": "journal"} for k, v in matched.reused.items()},
    )
    connector = aiohttp.TCPConnector(limit=settings.client.concurrency + 1, limit_per_host=0)
    started_at = time.time()
    try:
        with open_journal(journal, shard) as journal_file:
            async with aiohttp.ClientSession(connector=connector) as session:
                stop = asyncio.Event()
                watcher = asyncio.create_task(
                    watch_activity(
                        job.pool, session, job.headers_by_url, settings.client.activity_s, stop
                    )
                )
                try:
                    await _answer_all(todo, job, session, journal_file)
                finally:
                    stop.set()
                    await watcher
    finally:
        job.pool.close()
        job.progress.bar.close()
    summary = activity_summary(job.pool, started_at, time.time())
    _log_activity(shard, summary, job.progress)
    if activity is not None:
        write_json(activity, summary)
    return job.done


def _log_activity(shard: str, summary: dict[str, Any], progress: Progress) -> None:
    log.info(
        "shard %s: retries by kind %s, terminal errors by kind %s",
        shard,
        dict(progress.retries),
        dict(progress.errors),
    )
    wall_s = summary["finished_at"] - summary["started_at"]
    for endpoint in summary["endpoints"]:
        seen = [sample[1] for sample in endpoint["samples"]]
        log.info(
            "shard %s: endpoint %s: %.0f busy slot-seconds in %.1f s, %.2f of its cap of %d "
            "(this job alone); at most %s in flight over all jobs when sampled",
            shard,
            endpoint["url"],
            endpoint["busy_s"],
            wall_s,
            endpoint["utilisation"],
            endpoint["cap"],
            max(seen, default="-"),
        )


def load_prompts(path: str | Path) -> list[dict[str, Any]]:
    return pl.read_parquet(path, columns=["id", "messages"]).to_dicts()


def generate_shard(
    prompts: str | Path,
    probe: str | Path,
    out: str | Path,
    request: RequestSettings,
    client: GenerationClientSettings,
    journal: str | Path,
    server_log: str | Path | None = None,
    shard: str = "",
    activity: str | Path | None = None,
) -> dict[str, int]:
    """The generate stage for one shard: request, journal, then write raw/{shard}.parquet (and
    how busy the endpoints were to `activity`)."""
    prompt_rows = load_prompts(prompts)
    token_ids = read_json(probe)["token_ids"]
    settings = GenerationSettings.from_parts(
        request, client, token_ids["supported"], token_ids.get("layout")
    )
    with open_endpoints(client.endpoints, server_log) as endpoints:
        records = asyncio.run(
            generate_records(
                prompt_rows,
                endpoints,
                settings,
                Path(journal),
                shard,
                Path(activity) if activity is not None else None,
            )
        )
    rows = [records[p["id"]] for p in prompt_rows]
    errors = Counter(r["error_kind"] for r in rows if r["error_kind"] is not None)
    n_errors = sum(errors.values())
    if rows and n_errors / len(rows) > settings.client.max_error_fraction:
        raise GenerationError(
            f"shard {shard}: {n_errors} of {len(rows)} requests failed terminally "
            f"(> generation.max_error_fraction {settings.client.max_error_fraction}); by kind: "
            f"{dict(errors)}. The {len(rows) - n_errors} answers are kept in {journal}; "
            "fix the cause and rerun: only the failed ones are requested again."
        )
    write_raw(rows, out)
    return {"prompts": len(rows), "errors": n_errors}
