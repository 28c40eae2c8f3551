"""Generation: send every prompt of a shard to the target's endpoints and keep every answer.

Three promises, each from a lesson of the original run:
- nothing is lost: every finished request (answer or terminal failure) is appended to the shard's
  journal and flushed as it completes; a rerun skips the ids already answered;
- reasoning is read from whatever field the server used (`eaglenest.client.reasoning`), and the
  field is recorded per row;
- the API key never reaches the journal, the parquet or the logs.

The client is asyncio + aiohttp. httpx was measured here first: one AsyncClient with 128
connections spends ~22 ms of CPU per request and 16 clients still ~2.6 ms, which caps a 2-core
client near 400 requests/s; aiohttp costs ~0.8 ms, so the client stays far from being the
bottleneck (bench/generate.py compares this client with a bare aiohttp loop).
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import hashlib
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import polars as pl
from tqdm import tqdm

from eaglenest.client.credentials import api_key_from_env, auth_headers, redact
from eaglenest.client.endpoints import Endpoint, open_endpoints
from eaglenest.client.reasoning import extract_reasoning
from eaglenest.client.responses import extract_token_ids
from eaglenest.common.io import read_json
from eaglenest.formats.raw import RAW_SCHEMA, checked_token_ids, write_raw
from eaglenest.settings.generate import GenerationClientSettings, RequestSettings

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}

# Fields that change how an answer travels, not what is asked: a journaled answer to a body that
# differs only in these is the answer to the current request.
TRANSPORT_FIELDS = frozenset({"stream", "stream_options"})


class GenerationError(RuntimeError):
    """Too many terminal failures in a shard; what was answered is kept in the journal."""


@dataclass(frozen=True)
class GenerationSettings:
    """What one shard job runs with: the request settings (the rule's rerun trigger), the client
    settings (no reason to rerun) and whether to ask for token ids (what the probe found)."""

    request: RequestSettings
    client: GenerationClientSettings
    return_token_ids: bool

    @classmethod
    def from_parts(
        cls, request: RequestSettings, client: GenerationClientSettings, return_token_ids: bool
    ) -> GenerationSettings:
        return cls(request, client, return_token_ids)


def sample_seed(run_seed: int, sample_id: str) -> int:
    """Per-sample sampling seed: stable for (run seed, sample), independent of order and shard."""
    digest = hashlib.sha256(f"{run_seed}:{sample_id}".encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


def request_body(sample_id: str, messages: list[dict], settings: GenerationSettings) -> dict:
    body: dict[str, Any] = {
        "model": settings.request.model,
        "messages": messages,
        "temperature": settings.request.temperature,
        "top_p": settings.request.top_p,
        "max_tokens": settings.request.max_tokens,
        "seed": sample_seed(settings.request.seed, sample_id),
    }
    if settings.request.chat_template_kwargs:
        body["chat_template_kwargs"] = settings.request.chat_template_kwargs
    if settings.return_token_ids:
        body["return_token_ids"] = True
    body.update(settings.request.extra_body)
    return body


# --- one request -----------------------------------------------------------------------------


class RetryableError(Exception):
    def __init__(self, kind: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s


class TerminalError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds a `Retry-After` header asks to wait: delay-seconds or an HTTP date (RFC 9110);
    None when absent or unreadable. Capping is the caller's (see `_backoff_s`)."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # an obsolete date form without a zone: HTTP dates are GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


async def post_once(
    session: aiohttp.ClientSession, endpoint: Endpoint, body: dict, headers: dict, timeout_s: float
) -> tuple[dict, str]:
    """One POST; returns (parsed body, body text) or raises RetryableError / TerminalError."""
    url = f"{endpoint.url}/v1/chat/completions"
    try:
        async with session.post(
            url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            text = await response.text()
            if response.status in RETRYABLE_STATUS:
                raise RetryableError(
                    f"http_{response.status}",
                    text[:300],
                    retry_after_s(response.headers.get("Retry-After")),
                )
            if response.status != 200:
                raise TerminalError(f"http_{response.status}", text[:500])
    except asyncio.TimeoutError as err:
        raise RetryableError("timeout", f"no answer within {timeout_s} s") from err
    except aiohttp.ClientError as err:
        raise RetryableError("connection", f"{type(err).__name__}: {err}") from err
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        raise RetryableError("malformed_json", f"{err}: {text[:200]!r}") from err
    if not isinstance(parsed, dict) or not parsed.get("choices"):
        raise RetryableError("malformed_json", f"no choices in body: {text[:200]!r}")
    answered_by = parsed.get("model")
    if answered_by is not None and answered_by != body["model"]:
        # A router or proxy sent the request to another model: its answer is not the target's.
        raise TerminalError(
            "model_mismatch", f"asked model {body['model']!r}, answered by {answered_by!r}"
        )
    return parsed, text


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
    latency_s: float,
) -> dict[str, Any]:
    record = dict.fromkeys(RAW_SCHEMA)
    record.update(
        id=sample_id,
        endpoint=endpoint,
        request=json.dumps(body, sort_keys=True),
        reasoning_field="none",
        latency_s=round(latency_s, 4),
        attempts=attempts,
        error_kind=kind,
        error=error,
    )
    return record


# --- endpoints: least in flight, benched when failing ---------------------------------------


@dataclass
class EndpointState:
    endpoint: Endpoint
    in_flight: int = 0
    consecutive_failures: int = 0
    benched_until: float = 0.0


class EndpointPool:
    """Chooses the least-loaded endpoint under its own cap; an endpoint that keeps failing is
    benched for a while (unless every endpoint is, then the soonest back is used)."""

    def __init__(self, endpoints: list[Endpoint], bench_after_failures: int, bench_s: float):
        self.states = [EndpointState(e) for e in endpoints]
        self.bench_after_failures = bench_after_failures
        self.bench_s = bench_s
        self._changed = asyncio.Condition()

    def _choose(self) -> EndpointState | None:
        now = time.monotonic()
        free = [s for s in self.states if s.in_flight < s.endpoint.max_concurrency]
        healthy = [s for s in free if s.benched_until <= now]
        if not healthy and free and all(s.benched_until > now for s in self.states):
            healthy = [min(free, key=lambda s: s.benched_until)]
        return min(healthy, key=lambda s: s.in_flight) if healthy else None

    async def acquire(self) -> EndpointState:
        async with self._changed:
            while (state := self._choose()) is None:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass  # benching may have expired
            state.in_flight += 1
            return state

    async def release(self, state: EndpointState, ok: bool) -> None:
        async with self._changed:
            state.in_flight -= 1
            if ok:
                state.consecutive_failures = 0
            else:
                state.consecutive_failures += 1
                if state.consecutive_failures >= self.bench_after_failures:
                    state.benched_until = time.monotonic() + self.bench_s
                    state.consecutive_failures = 0
                    log.warning("endpoint %s benched for %.0f s", state.endpoint.url, self.bench_s)
            self._changed.notify_all()


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


async def request_with_retries(
    sample_id: str,
    body: dict,
    pool: EndpointPool,
    session: aiohttp.ClientSession,
    headers_by_url: dict[str, dict],
    settings: GenerationSettings,
    progress: Progress,
) -> dict[str, Any]:
    started = time.perf_counter()
    last_kind, last_error, last_url = "none", "", ""
    for attempt in range(1, settings.client.max_attempts + 1):
        state = await pool.acquire()
        url = last_url = state.endpoint.url
        progress.in_flight += 1
        try:
            response, text = await post_once(
                session, state.endpoint, body, headers_by_url[url], settings.client.timeout_s
            )
        except RetryableError as err:
            await pool.release(state, ok=False)
            last_kind, last_error = err.kind, str(err)
            progress.retries[err.kind] += 1
            if attempt < settings.client.max_attempts:
                await asyncio.sleep(_backoff_s(attempt, settings, err.retry_after_s))
            continue
        except TerminalError as err:
            await pool.release(state, ok=True)  # the endpoint answered; the request is at fault
            return failure_record(
                sample_id, url, body, err.kind, str(err), attempt, time.perf_counter() - started
            )
        finally:
            progress.in_flight -= 1
        await pool.release(state, ok=True)
        return record_from_response(
            sample_id, url, body, response, text, time.perf_counter() - started, attempt
        )
    return failure_record(
        sample_id,
        last_url,
        body,
        last_kind,
        f"gave up after {settings.client.max_attempts} attempts: {last_error}",
        settings.client.max_attempts,
        time.perf_counter() - started,
    )


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
        if same_request and record["error_kind"] is None:
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
    shard: str, n_prompts: int, n_asked: int, matched: JournalMatch, journal: Path
) -> None:
    counts = matched.counts()
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


async def generate_records(
    prompts: list[dict[str, Any]],
    endpoints: list[Endpoint],
    settings: GenerationSettings,
    journal: Path,
    shard: str = "",
) -> dict[str, dict[str, Any]]:
    """Answer every prompt whose current request the journal has not answered; return all
    records by id, each with its `origin` (journal, new, retry or settings_changed)."""
    bodies = {p["id"]: request_body(p["id"], p["messages"], settings) for p in prompts}
    matched = match_journal(journal, bodies)
    done = {k: v | {"origin": "journal"} for k, v in matched.reused.items()}
    todo = [p for p in prompts if p["id"] in matched.origins]
    _log_plan(shard, len(prompts), len(todo), matched, journal)
    secrets = [api_key_from_env(e.api_key_env) for e in endpoints]
    headers_by_url = {e.url: auth_headers(k) for e, k in zip(endpoints, secrets)}
    pool = EndpointPool(endpoints, settings.client.bench_after_failures, settings.client.bench_s)
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for prompt in todo:
        queue.put_nowait(prompt)
    journal.parent.mkdir(parents=True, exist_ok=True)
    connector = aiohttp.TCPConnector(limit=settings.client.concurrency, limit_per_host=0)
    progress = _progress(shard, len(prompts), already_done=len(prompts) - len(todo))
    with journal.open("a") as journal_file:
        if journal_file.tell() and not journal.read_bytes().endswith(b"\n"):
            journal_file.write("\n")  # end the line torn by a kill so the next record parses

        async def worker(session: aiohttp.ClientSession) -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                record = await request_with_retries(
                    prompt["id"],
                    bodies[prompt["id"]],
                    pool,
                    session,
                    headers_by_url,
                    settings,
                    progress,
                )
                record["origin"] = matched.origins[prompt["id"]]
                # Only the error can quote a secret (a proxy echoing headers); the model's text is
                # never touched, whatever the key happens to spell.
                record["error"] = redact(record["error"], secrets)
                journal_file.write(json.dumps(record, sort_keys=True) + "\n")
                journal_file.flush()  # on disk for the next run even if this one is killed
                done[prompt["id"]] = record
                if record["error_kind"] is not None:
                    progress.errors[record["error_kind"]] += 1
                progress.bar.update(1)
                progress.update_postfix()

        async with aiohttp.ClientSession(connector=connector) as session:
            workers = min(settings.client.concurrency, max(1, len(todo)))
            await asyncio.gather(*(worker(session) for _ in range(workers)))
    progress.bar.close()
    log.info(
        "shard %s: retries by kind %s, terminal errors by kind %s",
        shard,
        dict(progress.retries),
        dict(progress.errors),
    )
    return done


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
) -> dict[str, int]:
    """The generate stage for one shard: request, journal, then write raw/{shard}.parquet."""
    prompt_rows = load_prompts(prompts)
    probed = read_json(probe)
    settings = GenerationSettings.from_parts(request, client, probed["token_ids"]["supported"])
    with open_endpoints(client.endpoints, server_log) as endpoints:
        records = asyncio.run(
            generate_records(prompt_rows, endpoints, settings, Path(journal), shard)
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
