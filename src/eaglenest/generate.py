"""Generation: send every prompt of a shard to the target's endpoints and keep every answer.

Three promises, each from a lesson of the original run:
- nothing is lost: every finished request (answer or terminal failure) is appended to the shard's
  journal and flushed as it completes; a rerun skips the ids already answered;
- reasoning is read from whatever field the server used (`eaglenest.reasoning`), and the field is
  recorded per row;
- the API key never reaches the journal, the parquet or the logs.

The client is asyncio + aiohttp. httpx was measured here first (DESIGN.md): one AsyncClient with
128 connections spends ~22 ms of CPU per request and 16 clients still ~2.6 ms, which caps a
2-core client near 400 requests/s; aiohttp costs ~0.8 ms, so the client stays far from being the
bottleneck (see bench/generate.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import polars as pl
from tqdm import tqdm

from eaglenest.credentials import api_key_from_env, auth_headers, redact
from eaglenest.endpoints import Endpoint, open_endpoints
from eaglenest.io import atomic_path, read_json
from eaglenest.reasoning import extract_reasoning
from eaglenest.responses import extract_token_ids

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}

RAW_SCHEMA = {
    "id": pl.String,
    "endpoint": pl.String,
    "request": pl.String,  # the request body as sorted JSON (no secrets: keys go in headers)
    "response": pl.String,  # the raw response body, secrets removed; null on failure
    "reasoning": pl.String,
    "content": pl.String,
    "reasoning_field": pl.String,
    "finish_reason": pl.String,
    "prompt_token_ids": pl.List(pl.Int64),
    "completion_token_ids": pl.List(pl.Int64),
    "token_layout": pl.String,
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "latency_s": pl.Float64,
    "attempts": pl.Int64,
    "error_kind": pl.String,
    "error": pl.String,
}


class GenerationError(RuntimeError):
    """Too many terminal failures in a shard; what was answered is kept in the journal."""


@dataclass(frozen=True)
class GenerationSettings:
    model: str
    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int = 2048
    concurrency: int = 128
    timeout_s: float = 600.0
    max_attempts: int = 6
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    max_error_fraction: float = 0.02
    bench_after_failures: int = 5
    bench_s: float = 30.0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    return_token_ids: bool = True
    seed: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any], return_token_ids: bool) -> GenerationSettings:
        gen = config["generation"]
        return cls(
            model=config["target"]["model"],
            chat_template_kwargs=config["target"]["chat_template_kwargs"],
            return_token_ids=return_token_ids,
            seed=config["seed"],
            **{k: gen[k] for k in cls.__dataclass_fields__ if k in gen},
        )


def sample_seed(run_seed: int, sample_id: str) -> int:
    """Per-sample sampling seed: stable for (run seed, sample), independent of order and shard."""
    digest = hashlib.sha256(f"{run_seed}:{sample_id}".encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


def request_body(sample_id: str, messages: list[dict], settings: GenerationSettings) -> dict:
    body: dict[str, Any] = {
        "model": settings.model,
        "messages": messages,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "max_tokens": settings.max_tokens,
        "seed": sample_seed(settings.seed, sample_id),
    }
    if settings.chat_template_kwargs:
        body["chat_template_kwargs"] = settings.chat_template_kwargs
    if settings.return_token_ids:
        body["return_token_ids"] = True
    body.update(settings.extra_body)
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


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


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
                    f"http_{response.status}", text[:300], _retry_after(response.headers)
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
    return {
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
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "latency_s": round(latency_s, 4),
        "attempts": attempts,
        "error_kind": None,
        "error": None,
    }


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


def _backoff_s(attempt: int, settings: GenerationSettings, retry_after_s: float | None) -> float:
    backoff = min(settings.backoff_max_s, settings.backoff_base_s * 2 ** (attempt - 1))
    backoff *= random.uniform(0.5, 1.5)  # jitter: retries of a burst do not arrive together
    return max(backoff, retry_after_s or 0.0)


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
    for attempt in range(1, settings.max_attempts + 1):
        state = await pool.acquire()
        url = last_url = state.endpoint.url
        progress.in_flight += 1
        try:
            response, text = await post_once(
                session, state.endpoint, body, headers_by_url[url], settings.timeout_s
            )
        except RetryableError as err:
            await pool.release(state, ok=False)
            last_kind, last_error = err.kind, str(err)
            progress.retries[err.kind] += 1
            if attempt < settings.max_attempts:
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
        f"gave up after {settings.max_attempts} attempts: {last_error}",
        settings.max_attempts,
        time.perf_counter() - started,
    )


def read_journal(journal: Path) -> dict[str, dict[str, Any]]:
    """Records of earlier runs by id; answers win over failures; a torn last line is ignored."""
    records: dict[str, dict[str, Any]] = {}
    if not journal.exists():
        return records
    with journal.open() as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line being written when the process was killed
            previous = records.get(record["id"])
            if previous is None or previous["error_kind"] is not None:
                records[record["id"]] = record
    return records


async def generate_records(
    prompts: list[dict[str, Any]],
    endpoints: list[Endpoint],
    settings: GenerationSettings,
    journal: Path,
    shard: str = "",
) -> dict[str, dict[str, Any]]:
    """Answer every prompt not already answered in the journal; return all records by id."""
    done = read_journal(journal)
    todo = [p for p in prompts if done.get(p["id"], {}).get("error_kind", "x") is not None]
    log.info(
        "shard %s: %d prompts, %d already answered in %s, %d to request",
        shard,
        len(prompts),
        len(prompts) - len(todo),
        journal,
        len(todo),
    )
    secrets = [api_key_from_env(e.api_key_env) for e in endpoints]
    headers_by_url = {e.url: auth_headers(k) for e, k in zip(endpoints, secrets)}
    pool = EndpointPool(endpoints, settings.bench_after_failures, settings.bench_s)
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for prompt in todo:
        queue.put_nowait(prompt)
    journal.parent.mkdir(parents=True, exist_ok=True)
    connector = aiohttp.TCPConnector(limit=settings.concurrency, limit_per_host=0)
    bar = tqdm(
        total=len(prompts),
        initial=len(prompts) - len(todo),
        desc=f"generate {shard}",
        unit="req",
        mininterval=1.0,
        smoothing=0.1,
    )
    progress = Progress(bar)
    with journal.open("a") as journal_file:
        if journal_file.tell() and not journal.read_bytes().endswith(b"\n"):
            journal_file.write("\n")  # end the line torn by a kill so the next record parses

        async def worker(session: aiohttp.ClientSession) -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                body = request_body(prompt["id"], prompt["messages"], settings)
                record = await request_with_retries(
                    prompt["id"], body, pool, session, headers_by_url, settings, progress
                )
                record = redact(record, secrets)
                journal_file.write(json.dumps(record, sort_keys=True) + "\n")
                journal_file.flush()  # on disk for the next run even if this one is killed
                done[prompt["id"]] = record
                if record["error_kind"] is not None:
                    progress.errors[record["error_kind"]] += 1
                bar.update(1)
                progress.update_postfix()

        async with aiohttp.ClientSession(connector=connector) as session:
            workers = min(settings.concurrency, max(1, len(todo)))
            await asyncio.gather(*(worker(session) for _ in range(workers)))
    bar.close()
    log.info(
        "shard %s: retries by kind %s, terminal errors by kind %s",
        shard,
        dict(progress.retries),
        dict(progress.errors),
    )
    return done


def load_prompts(path: str | Path) -> list[dict[str, Any]]:
    return pl.read_parquet(path, columns=["id", "messages"]).to_dicts()


def write_raw(records: Iterable[dict[str, Any]], out: str | Path) -> None:
    frame = pl.DataFrame(list(records), schema=RAW_SCHEMA)
    with atomic_path(out) as tmp:
        frame.write_parquet(tmp)


def generate_shard(
    prompts: str | Path,
    probe: str | Path,
    out: str | Path,
    config: dict[str, Any],
    journal: str | Path,
    server_log: str | Path | None = None,
    shard: str = "",
) -> dict[str, int]:
    """The generate stage for one shard: request, journal, then write raw/{shard}.parquet."""
    prompt_rows = load_prompts(prompts)
    probed = read_json(probe)
    settings = GenerationSettings.from_config(config, probed["token_ids"]["supported"])
    with open_endpoints(config, server_log) as endpoints:
        records = asyncio.run(
            generate_records(prompt_rows, endpoints, settings, Path(journal), shard)
        )
    rows = [records[p["id"]] for p in prompt_rows]
    errors = Counter(r["error_kind"] for r in rows if r["error_kind"] is not None)
    n_errors = sum(errors.values())
    if rows and n_errors / len(rows) > settings.max_error_fraction:
        raise GenerationError(
            f"shard {shard}: {n_errors} of {len(rows)} requests failed terminally "
            f"(> generation.max_error_fraction {settings.max_error_fraction}); by kind: "
            f"{dict(errors)}. The {len(rows) - n_errors} answers are kept in {journal}; "
            "fix the cause and rerun: only the failed ones are requested again."
        )
    write_raw(rows, out)
    return {"prompts": len(rows), "errors": n_errors}
