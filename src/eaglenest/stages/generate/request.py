"""One prompt's request: the settings a shard job sends it with, the body sent, and the raw row
its answer or terminal failure becomes (formats/raw.py). Sending it, with retries, is
eaglenest.stages.generate.generate's."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from eaglenest.client.retry import RetryPolicy
from eaglenest.common.reasoning import extract_reasoning
from eaglenest.formats.raw import RAW_SCHEMA, checked_token_ids
from eaglenest.formats.response_ids import extract_token_ids
from eaglenest.settings.generate import GenerationClientSettings, RequestSettings

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

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy of every request (eaglenest.client.retry), from generation.*."""
        c = self.client
        return RetryPolicy(c.max_attempts, c.backoff_base_s, c.backoff_max_s, c.retry_after_max_s)


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


@dataclass
class Attempt:
    """What one prompt's attempts cost: the seconds spent waiting for slots, and in flight."""

    slot_wait_s: float = 0.0
    in_flight_s: float = 0.0  # of the latest attempt: the answer's latency, not its queueing


def timing(spent: Attempt) -> dict[str, float]:
    return {
        "latency_s": round(spent.in_flight_s, 4),
        "slot_wait_s": round(spent.slot_wait_s, 4),
    }
