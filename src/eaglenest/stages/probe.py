"""The probe: one minimal request per endpoint, before any real work.

This is the step that would have saved the original run (2,700 requests, reasoning read from the
wrong field): look at one raw response, say which field carries the reasoning and whether token
ids come back, and fail in seconds with a message that says what to fix. Plain httpx, no client
library, so nothing between us and the raw body.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx

from eaglenest.client.credentials import (
    ApiKeyError,
    api_key_from_env,
    auth_headers,
    key_hint,
    redact,
    url_secrets,
)
from eaglenest.client.endpoints import Endpoint, open_endpoints
from eaglenest.client.responses import describe_token_ids
from eaglenest.client.retry import RETRYABLE_STATUS, RetryPolicy
from eaglenest.common.io import write_json
from eaglenest.common.reasoning import (
    NO_FIELD,
    THINK_END,
    extract_reasoning,
    present_fields,
)
from eaglenest.common.thinking import switch_value
from eaglenest.settings.probe import ProbeClientSettings, ProbeSettings
from eaglenest.settings.urls import api_base, endpoint_path, redacted_url
from eaglenest.target_model.tokenizer import think_token_ids

log = logging.getLogger(__name__)

# A few quick attempts: the probe is the run's first request, and must fail in seconds.
PROBE_RETRY = RetryPolicy(max_attempts=3, backoff_base_s=0.5, backoff_max_s=2.0)
# Only for `eaglenest probe` by hand; in a run the probe asks the run's own first prompts.
DEFAULT_PROMPT = "What is 12 + 7? Think step by step."


class ProbeError(RuntimeError):
    """The endpoint cannot be used as configured; the message says why and what to change."""


def _served_models(client: httpx.Client, base: str, auth_hint: str) -> list[str]:
    shown = redacted_url(base)  # messages and logs never show a URL's credentials
    models_url = endpoint_path(shown, "/v1/models")
    try:
        response = client.get(endpoint_path(base, "/v1/models"))
    except httpx.TransportError as err:
        raise ProbeError(
            f"endpoint {shown} is unreachable ({type(err).__name__}: {err}); is the server running "
            "and the URL (host, port) right?"
        ) from err
    if response.status_code in (401, 403):
        raise ProbeError(
            f"endpoint {shown} refused the request with HTTP {response.status_code}: {auth_hint}"
        )
    if response.status_code != 200:
        raise ProbeError(f"endpoint {models_url} answered HTTP {response.status_code}")
    try:
        listing = response.json()
    except json.JSONDecodeError:
        listing = None
    if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        raise ProbeError(
            f"{models_url} did not answer an OpenAI model list (a JSON object with 'data'): "
            f"{response.text[:200]!r}. Is the URL the server's API base, not a web page or proxy?"
        )
    return [m.get("id") for m in listing["data"] if isinstance(m, dict)]


def _post_chat(
    client: httpx.Client, base: str, body: dict[str, Any], secrets: list[str | None]
) -> tuple[dict, float, int]:
    """POST with a few quick retries on transient failures; returns (json, latency_s, attempts).
    What it logs is without `secrets` (a proxy may echo the request in its answer)."""
    last_problem, shown = "", redacted_url(base)
    chat_url = endpoint_path(shown, "/v1/chat/completions")
    attempts = PROBE_RETRY.max_attempts
    for attempt in range(1, attempts + 1):
        started = time.perf_counter()
        try:
            response = client.post(endpoint_path(base, "/v1/chat/completions"), json=body)
        except httpx.TransportError as err:
            last_problem = f"{type(err).__name__}: {err}"
        else:
            latency_s = time.perf_counter() - started
            if response.status_code == 200:
                try:
                    parsed = response.json()
                except json.JSONDecodeError:
                    parsed = None
                if isinstance(parsed, dict):
                    return parsed, latency_s, attempt
                last_problem = f"malformed JSON body: {response.text[:200]!r}"
            elif response.status_code in RETRYABLE_STATUS:
                last_problem = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                raise ProbeError(
                    f"{chat_url} answered HTTP {response.status_code}: {response.text[:500]}"
                )
        shown_problem = redact(last_problem, secrets)
        log.warning("probe attempt %d/%d on %s failed: %s", attempt, attempts, shown, shown_problem)
        if PROBE_RETRY.retries(attempt):
            time.sleep(PROBE_RETRY.backoff_s(attempt))
    raise ProbeError(f"{chat_url} failed {attempts} times; last: {last_problem}")


def _empty_reasoning_message(base: str, model: str, answers: list[dict[str, Any]]) -> str:
    fields = ", ".join(f"{k}: {v}" for k, v in answers[0]["fields"].items())
    cut = sum(a["finish_reason"] == "length" for a in answers)
    hint = (
        f" {cut} of them were cut by max_tokens before the think block closed: raise "
        "probe.max_tokens if the model thinks long."
        if cut
        else ""
    )
    return (
        f"reasoning is empty in every field of all {len(answers)} probe answers from {base} "
        f"(model '{model}'); fields present in the first: {fields}; the content has no "
        f"{THINK_END} either.{hint} The server is not returning the reasoning: start vLLM with "
        "`--reasoning-parser <parser>` (e.g. qwen3, deepseek_r1, kimi_k2) or SGLang with "
        "`--reasoning-parser <parser>`, and check that target.chat_template_kwargs turns "
        "thinking on (e.g. enable_thinking: true or thinking: true)."
    )


def _answer_summary(
    messages: list[dict[str, Any]], response: dict[str, Any], latency_s: float, attempts: int
) -> dict[str, Any]:
    """What one probe answer showed: where the reasoning was, token ids, how it finished."""
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    parts = extract_reasoning(message)
    last_user = next((m.get("content") for m in reversed(messages) if m["role"] == "user"), "")
    return {
        "prompt_preview": str(last_user)[:200],
        "latency_s": round(latency_s, 4),
        "attempts": attempts,
        "model": response.get("model"),
        "reasoning_field": parts.field,
        "fields": present_fields(message),
        "reasoning_preview": parts.reasoning[:200],
        "content_preview": (parts.content or "")[:200],
        "finish_reason": choice.get("finish_reason"),
        "usage": response.get("usage"),
        "token_ids": describe_token_ids(response),
    }


def _reasoning_field(answers: list[dict[str, Any]]) -> str:
    """The field the answers with reasoning used; 'mixed' when they disagree."""
    fields = sorted({a["reasoning_field"] for a in answers} - {NO_FIELD})
    if not fields:
        return NO_FIELD
    return fields[0] if len(fields) == 1 else "mixed"


def _ask(
    client: httpx.Client,
    base: str,
    model: str,
    bodies: list[dict[str, Any]],
    endpoint: Endpoint,
    api_key: str | None,
) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """Check the model is served, then send each body: (served models, responses, summaries)."""
    served = _served_models(client, base, key_hint(endpoint.api_key_env, api_key))
    if model not in served:
        raise ProbeError(
            f"model '{model}' is not served by {redacted_url(base)}; served: {served}. "
            "Set target.model to one of them."
        )
    responses, answers = [], []
    for body in bodies:
        secrets = [api_key, *url_secrets(base)]
        response, latency_s, attempts = _post_chat(client, base, body, secrets)
        answered_by = response.get("model")
        if answered_by is not None and answered_by != model:
            raise ProbeError(
                f"{redacted_url(base)} answered a request for model '{model}' with model '{answered_by}': "
                "a router or proxy in front of the server is sending the run to another model"
            )
        responses.append(response)
        answers.append(_answer_summary(body["messages"], response, latency_s, attempts))
    return served, responses, answers


def _request_bodies(
    model: str,
    prompts: list[list[dict[str, Any]]] | None,
    max_tokens: int,
    chat_template_kwargs: dict[str, Any] | None,
    extra_body: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """One chat request per prompt (default: the fixed question), asking for token ids."""
    bodies = []
    for messages in prompts or [[{"role": "user", "content": DEFAULT_PROMPT}]]:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            **(extra_body or {}),
        }
        if chat_template_kwargs:
            body["chat_template_kwargs"] = chat_template_kwargs
        bodies.append(body)
    return bodies


def _answers_without_reasoning(
    base: str, model: str, answers: list[dict[str, Any]], require_reasoning: bool, switch_off: bool
) -> list[int]:
    """Indices of the answers without reasoning; raise when all lack it and it is required
    (and asked for: a request that switched thinking off wants answers without it)."""
    empty = [i for i, a in enumerate(answers) if a["reasoning_field"] == NO_FIELD]
    if switch_off:
        log.info(
            "probe %s: asked with thinking off; %d of %d answers have no reasoning, as asked",
            base,
            len(empty),
            len(answers),
        )
        return empty
    if require_reasoning and len(empty) == len(answers):
        raise ProbeError(_empty_reasoning_message(base, model, answers))
    if empty:
        log.warning(
            "probe %s: %d of %d answers have no reasoning (prompts %s); the others do, so the "
            "run goes on; validation counts such rows per shard",
            base,
            len(empty),
            len(answers),
            empty,
        )
    return empty


def _check_token_ids(base: str, answers: list[dict[str, Any]], require_token_ids: bool) -> bool:
    """Whether every answer carried token ids; raise when they are required and missing or
    malformed (malformed ones are a warning otherwise)."""
    token_ids = [a["token_ids"] for a in answers]
    supported = all(t["supported"] for t in token_ids)
    problems = [t["problem"] for t in token_ids if t.get("problem")]
    if problems:
        log.warning("probe %s: token ids the server sent are malformed: %s", base, problems[0])
    if require_token_ids and problems:
        raise ProbeError(
            f"{base} returned malformed token ids ({problems[0]}; {len(problems)} of "
            f"{len(token_ids)} answers) although probe.require_token_ids is true: the server or a "
            "proxy in front of it mangles them. Fix that, or set probe.require_token_ids: false "
            "to rebuild ids with the tokenizer."
        )
    if require_token_ids and not supported:
        raise ProbeError(
            f"{base} returned no token ids although probe.require_token_ids is true (asked with "
            "return_token_ids: true; looked for top-level prompt_token_ids + choices[].token_ids "
            "(vLLM >= 0.10.2) and choices[].prompt_token_ids + response_token_ids (SGLang)). "
            "Upgrade the server, or set probe.require_token_ids: false to rebuild ids with the "
            "tokenizer."
        )
    return supported


def probe_endpoint(
    endpoint: Endpoint,
    model: str,
    *,
    prompts: list[list[dict[str, Any]]] | None = None,
    max_tokens: int = 256,
    timeout_s: float = 60.0,
    chat_template_kwargs: dict[str, Any] | None = None,
    extra_body: dict[str, Any] | None = None,
    require_token_ids: bool = False,
    require_reasoning: bool = True,
) -> dict[str, Any]:
    """Probe one endpoint with `prompts` (message lists; default: one fixed question); return
    what it said, or raise ProbeError saying what is wrong.

    The reasoning check fails only when every answer lacks reasoning: a real target may skip
    thinking on one trivial prompt, which is a warning, not a broken server. With the thinking
    switch off in `chat_template_kwargs` (common/thinking.py) answers without reasoning are what
    was asked, and pass.
    """
    base = api_base(endpoint.url)
    try:
        api_key = api_key_from_env(endpoint.api_key_env)
    except ApiKeyError as err:  # a blank variable read as "unreachable" (an illegal header)
        raise ProbeError(str(err)) from None
    bodies = _request_bodies(model, prompts, max_tokens, chat_template_kwargs, extra_body)
    timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))
    try:
        with httpx.Client(timeout=timeout, headers=auth_headers(api_key)) as client:
            served, responses, answers = _ask(client, base, model, bodies, endpoint, api_key)
    except ProbeError as err:
        # Error texts quote what the server said, which a proxy may fill with our headers.
        raise ProbeError(redact(str(err), [api_key, *url_secrets(base)])) from None
    shown_base = redacted_url(base)
    switch_off = switch_value(chat_template_kwargs) is False
    empty = _answers_without_reasoning(shown_base, model, answers, require_reasoning, switch_off)
    supported = _check_token_ids(shown_base, answers, require_token_ids)
    shown = next((i for i in range(len(answers)) if i not in empty), 0)
    # No redaction here: the key travels only in headers, and the model's text is kept as it is.
    return {
        "url": shown_base,
        "model": model,
        "served_models": served,
        "request": bodies[shown],
        "latency_s": answers[shown]["latency_s"],
        "attempts": answers[shown]["attempts"],
        "reasoning_field": _reasoning_field(answers),
        "fields": answers[shown]["fields"],
        "reasoning_preview": answers[shown]["reasoning_preview"],
        "content_preview": answers[shown]["content_preview"],
        "finish_reason": answers[shown]["finish_reason"],
        "usage": answers[shown]["usage"],
        "token_ids": answers[shown]["token_ids"] | {"supported": supported},
        "answers": answers,
        "answers_without_reasoning": len(empty),
        "thinking_switch": switch_value(chat_template_kwargs),  # null: the template's default
        "raw_response": responses[shown],
    }


def summarise(results: list[dict[str, Any]], think_ids: dict[str, Any]) -> dict[str, Any]:
    """probe.json: per-endpoint results and the run-wide answers later stages read."""
    fields = sorted({r["reasoning_field"] for r in results})
    layouts = sorted({str(r["token_ids"]["layout"]) for r in results})
    return {
        "model": results[0]["model"],
        "created_unix": int(time.time()),
        "reasoning_field": fields[0] if len(fields) == 1 else "mixed",
        "reasoning_fields": fields,
        "token_ids": {
            "supported": all(r["token_ids"]["supported"] for r in results),
            "layout": layouts[0] if len(layouts) == 1 else "mixed",
        },
        "answers_without_reasoning": sum(r["answers_without_reasoning"] for r in results),
        "answers": sum(len(r["answers"]) for r in results),
        "think_token_ids": think_ids,
        "endpoints": results,
    }


def probe_prompts(
    prompt_list: str | Path | None, count: int, fixed: str | None
) -> list[list[dict]]:
    """The messages the probe sends: the first `count` prompts of the run's own list (what the
    run will ask, so the target answers the way it will in the run) plus the fixed one, if any."""
    import polars as pl

    prompts: list[list[dict]] = []
    if prompt_list is not None and count:
        rows = pl.read_parquet(prompt_list, columns=["messages"], n_rows=count)
        prompts = [list(m) for m in rows["messages"].to_list()]
    if fixed:
        prompts.append([{"role": "user", "content": fixed}])
    if not prompts:
        raise ProbeError(
            "the probe has nothing to send: the run's prompt list is empty or probe.prompts is 0, "
            "and probe.prompt is not set"
        )
    return prompts


def probe_think_ids(settings: ProbeSettings) -> dict[str, Any]:
    """The think token ids probe.json records, which every later stage reads from there:
    target.think_tokens' ids where given, else the target tokenizer's (one token each)."""
    target = settings.target
    return think_token_ids(
        target.tokenizer or target.path,
        trust_remote_code=target.trust_remote_code,
        **target.think_tokens,
    )


def probe_endpoints(
    settings: ProbeSettings,
    endpoints: list[Endpoint],
    out: str | Path | None,
    timeout_s: float,
    prompt_list: str | Path | None = None,
) -> dict[str, Any]:
    """Probe every endpoint of the run and write probe.json."""
    think_ids = probe_think_ids(settings)
    prompts = probe_prompts(prompt_list, settings.prompts, settings.prompt)
    results = []
    for endpoint in endpoints:
        result = probe_endpoint(
            endpoint,
            settings.target.model,
            prompts=prompts,
            max_tokens=settings.max_tokens,
            timeout_s=timeout_s,
            chat_template_kwargs=settings.target.chat_template_kwargs,
            extra_body=settings.extra_body,
            require_token_ids=settings.require_token_ids,
            require_reasoning=settings.require_reasoning,
        )
        log.info(
            "probe %s: reasoning in '%s' (%d of %d answers without), token ids %s, %.3f s",
            endpoint.name,
            result["reasoning_field"],
            result["answers_without_reasoning"],
            len(result["answers"]),
            result["token_ids"]["layout"] or "absent",
            result["latency_s"],
        )
        results.append(result)
    summary = summarise(results, think_ids) | {"embedded_server": settings.embedded_server}
    if out is not None:
        write_json(out, summary)
    return summary


def probe_run(
    settings: ProbeSettings,
    client: ProbeClientSettings,
    out: str | Path,
    server_log: str | Path | None,
    prompt_list: str | Path | None = None,
) -> dict:
    """The probe stage: open the run's endpoints (starting the embedded server if configured)."""
    with open_endpoints(client.endpoints, server_log) as endpoints:
        return probe_endpoints(settings, endpoints, out, client.timeout_s, prompt_list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="model name as served")
    parser.add_argument("--api-key-env", help="environment variable holding the API key")
    parser.add_argument("--tokenizer", help="tokenizer path or name, for the think token ids")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--chat-template-kwargs", type=json.loads, default=None, help="JSON object")
    parser.add_argument(
        "--prompt",
        action="append",
        help=f"a user prompt to send (repeat for several; default {DEFAULT_PROMPT!r})",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--require-token-ids", action="store_true")
    parser.add_argument("--out", help="write the full probe JSON here (default: print a summary)")


def run(args: argparse.Namespace) -> int:
    try:
        think_ids = think_token_ids(args.tokenizer, trust_remote_code=args.trust_remote_code)
        result = probe_endpoint(
            Endpoint(url=args.endpoint, api_key_env=args.api_key_env),
            args.model,
            prompts=[[{"role": "user", "content": p}] for p in args.prompt or []],
            max_tokens=args.max_tokens,
            timeout_s=args.timeout_s,
            chat_template_kwargs=args.chat_template_kwargs,
            require_token_ids=args.require_token_ids,
        )
    except (ProbeError, KeyError) as err:
        print(f"probe failed: {err}")
        return 1
    summary = summarise([result], think_ids)
    if args.out:
        write_json(args.out, summary)
    print(f"endpoint:        {result['url']} (model '{result['model']}')")
    print(f"reasoning field: {result['reasoning_field']}")
    without = result["answers_without_reasoning"]
    print(f"answers:         {len(result['answers'])}, {without} without reasoning")
    print(f"fields:          {result['fields']}")
    print(f"token ids:       {result['token_ids']['layout'] or 'absent'}")
    print(f"think token ids: {think_ids.get('start_id')}, {think_ids.get('end_id')}")
    print(f"finish reason:   {result['finish_reason']}; latency {result['latency_s']} s")
    print(f"reasoning:       {result['reasoning_preview']!r}")
    print(f"content:         {result['content_preview']!r}")
    return 0
