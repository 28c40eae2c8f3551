"""Generation: send every prompt of a shard to the target's endpoints and keep every answer.

Three promises, each from a lesson of the original run:
- nothing is lost: every finished request (answer or terminal failure) is appended to the shard's
  journal and flushed as it completes; a rerun skips the ids already answered;
- reasoning is read from whatever field the server used (`eaglenest.common.reasoning`), and the
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
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import polars as pl
from tqdm import tqdm

from eaglenest.client.chat import RetryableError, TerminalError, post_once
from eaglenest.client.credentials import api_key_from_env, auth_headers, redact, url_secrets
from eaglenest.client.endpoints import Endpoint, open_endpoints
from eaglenest.client.journal import JournalMatch, match_journal, open_journal
from eaglenest.client.pool import EndpointPool, Slot, activity_summary, watch_activity
from eaglenest.common.io import read_json, write_json
from eaglenest.formats.raw import write_raw
from eaglenest.settings.generate import GenerationClientSettings, RequestSettings
from eaglenest.stages.generate.request import (
    Attempt,
    GenerationSettings,
    failure_record,
    record_from_response,
    request_body,
    timing,
)

log = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """Too many terminal failures in a shard; what was answered is kept in the journal."""


# --- one prompt's attempts ---------------------------------------------------------------


@dataclass
class ShardProgress:
    """The shard's progress bar and its counts of retries, errors and requests in flight."""

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
        # Credentials' forms scrubbed: the error may quote an answer that echoes the request.
        shown = redact(repr(err), [])
        log.warning("an answer from %s raised %s; retried", slot.state.endpoint.name, shown)
        raise RetryableError("client_error", f"{type(err).__name__}: {err}"[:500]) from err


async def request_with_retries(
    sample_id: str,
    body: dict,
    pool: EndpointPool,
    session: aiohttp.ClientSession,
    headers_by_url: dict[str, dict],
    settings: GenerationSettings,
    progress: ShardProgress,
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
            if settings.retry.retries(attempt):
                await asyncio.sleep(settings.retry.backoff_s(attempt, err.retry_after_s))
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


# --- the shard --------------------------------------------------------------------------------


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


def _progress(shard: str, total: int, already_done: int) -> ShardProgress:
    bar = tqdm(
        total=total,
        initial=already_done,
        desc=f"generate {shard}",
        unit="req",
        mininterval=1.0,
        smoothing=0.1,
    )
    return ShardProgress(bar)


@dataclass
class ShardRequests:
    """What the workers of one shard job share."""

    bodies: dict[str, dict[str, Any]]
    origins: dict[str, str]
    settings: GenerationSettings
    pool: EndpointPool
    headers_by_url: dict[str, dict]
    secrets: list[str | None]
    progress: ShardProgress
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
    keys = [
        api_key_from_env(e.api_key_env, f"endpoints[{i}].api_key_env")
        for i, e in enumerate(endpoints)
    ]
    for i, (endpoint, key) in enumerate(zip(endpoints, keys, strict=True)):
        if endpoint.api_key_env and not key:  # a server that wants one answers 401
            log.warning(
                "endpoints[%d].api_key_env names %s, which is empty: no key is sent",
                i,
                endpoint.api_key_env,
            )
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


def _log_activity(shard: str, summary: dict[str, Any], progress: ShardProgress) -> None:
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
