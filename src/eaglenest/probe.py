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

from eaglenest.credentials import api_key_from_env, auth_headers, redact
from eaglenest.endpoints import Endpoint, api_base, open_endpoints
from eaglenest.io import write_json
from eaglenest.reasoning import NO_FIELD, THINK_END, THINK_START, extract_reasoning, present_fields
from eaglenest.responses import describe_token_ids

log = logging.getLogger(__name__)

TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
PROBE_ATTEMPTS = 3


class ProbeError(RuntimeError):
    """The endpoint cannot be used as configured; the message says why and what to change."""


def think_token_ids(
    tokenizer_path: str | None,
    *,
    trust_remote_code: bool = False,
    start: str = THINK_START,
    end: str = THINK_END,
    start_id: int | None = None,
    end_id: int | None = None,
) -> dict[str, Any]:
    """Ids of the think tokens: from config when given, else from the tokenizer (one id each)."""
    result: dict[str, Any] = {"start": start, "end": end, "start_id": start_id, "end_id": end_id}
    if start_id is not None and end_id is not None:
        return result | {"source": "config"}
    if tokenizer_path is None:
        return result | {"source": "unknown (no tokenizer configured)"}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    for name, token, override in (("start", start, start_id), ("end", end, end_id)):
        if override is not None:
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise ProbeError(
                f"tokenizer '{tokenizer_path}' has no single token for '{token}': set "
                f"target.think_tokens.{name} to the model's think token or "
                f"target.think_tokens.{name}_id to its id"
            )
        result[f"{name}_id"] = int(token_id)
    return result | {"source": "tokenizer"}


def _served_models(client: httpx.Client, base: str) -> list[str]:
    try:
        response = client.get(f"{base}/v1/models")
    except httpx.TransportError as err:
        raise ProbeError(
            f"endpoint {base} is unreachable ({type(err).__name__}: {err}); is the server running "
            "and the URL (host, port) right?"
        ) from err
    if response.status_code in (401, 403):
        raise ProbeError(
            f"endpoint {base} refused the request with HTTP {response.status_code}: set the API key "
            "in the environment variable named by endpoints[].api_key_env"
        )
    if response.status_code != 200:
        raise ProbeError(f"endpoint {base}/v1/models answered HTTP {response.status_code}")
    return [m.get("id") for m in response.json().get("data", [])]


def _post_chat(client: httpx.Client, base: str, body: dict[str, Any]) -> tuple[dict, float, int]:
    """POST with a few quick retries on transient failures; returns (json, latency_s, attempts)."""
    last_problem = ""
    for attempt in range(1, PROBE_ATTEMPTS + 1):
        started = time.perf_counter()
        try:
            response = client.post(f"{base}/v1/chat/completions", json=body)
        except httpx.TransportError as err:
            last_problem = f"{type(err).__name__}: {err}"
        else:
            latency_s = time.perf_counter() - started
            if response.status_code == 200:
                try:
                    return response.json(), latency_s, attempt
                except json.JSONDecodeError:
                    last_problem = f"malformed JSON body: {response.text[:200]!r}"
            elif response.status_code in TRANSIENT_STATUS:
                last_problem = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                raise ProbeError(
                    f"{base}/v1/chat/completions answered HTTP {response.status_code}: "
                    f"{response.text[:500]}"
                )
        log.warning(
            "probe attempt %d/%d on %s failed: %s", attempt, PROBE_ATTEMPTS, base, last_problem
        )
        time.sleep(0.5 * attempt)
    raise ProbeError(
        f"{base}/v1/chat/completions failed {PROBE_ATTEMPTS} times; last: {last_problem}"
    )


def _empty_reasoning_message(base: str, model: str, message: dict[str, Any]) -> str:
    fields = ", ".join(f"{k}: {v}" for k, v in present_fields(message).items())
    return (
        f"reasoning is empty in every field of the response from {base} (model '{model}'); "
        f"fields present: {fields}; the content has no {THINK_END} either. The server is not "
        "returning the reasoning: start vLLM with `--reasoning-parser <parser>` (e.g. qwen3, "
        "deepseek_r1, kimi_k2) or SGLang with `--reasoning-parser <parser>`, and check that "
        "target.chat_template_kwargs turns thinking on (e.g. enable_thinking: true or thinking: true)."
    )


def probe_endpoint(
    endpoint: Endpoint,
    model: str,
    *,
    prompt: str = "What is 12 + 7? Think step by step.",
    max_tokens: int = 256,
    timeout_s: float = 60.0,
    chat_template_kwargs: dict[str, Any] | None = None,
    extra_body: dict[str, Any] | None = None,
    require_token_ids: bool = False,
    require_reasoning: bool = True,
) -> dict[str, Any]:
    """Probe one endpoint; return what it said, or raise ProbeError saying what is wrong."""
    base = api_base(endpoint.url)
    api_key = api_key_from_env(endpoint.api_key_env)
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        **(extra_body or {}),
    }
    if chat_template_kwargs:
        body["chat_template_kwargs"] = chat_template_kwargs
    timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))
    with httpx.Client(timeout=timeout, headers=auth_headers(api_key)) as client:
        served = _served_models(client, base)
        if model not in served:
            raise ProbeError(
                f"model '{model}' is not served by {base}; served: {served}. "
                "Set target.model to one of them."
            )
        response, latency_s, attempts = _post_chat(client, base, body)
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    parts = extract_reasoning(message)
    if require_reasoning and parts.field == NO_FIELD:
        raise ProbeError(_empty_reasoning_message(base, model, message))
    token_ids = describe_token_ids(response)
    if require_token_ids and not token_ids["supported"]:
        raise ProbeError(
            f"{base} returned no token ids although probe.require_token_ids is true (asked with "
            "return_token_ids: true; looked for top-level prompt_token_ids + choices[].token_ids "
            "(vLLM >= 0.10.2) and choices[].prompt_token_ids + response_token_ids (SGLang)). "
            "Upgrade the server, or set probe.require_token_ids: false to rebuild ids with the "
            "tokenizer."
        )
    return redact(
        {
            "url": base,
            "model": model,
            "served_models": served,
            "request": body,
            "latency_s": round(latency_s, 4),
            "attempts": attempts,
            "reasoning_field": parts.field,
            "fields": present_fields(message),
            "reasoning_preview": parts.reasoning[:200],
            "content_preview": (parts.content or "")[:200],
            "finish_reason": choice.get("finish_reason"),
            "usage": response.get("usage"),
            "token_ids": token_ids,
            "raw_response": response,
        },
        [api_key],
    )


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
        "think_token_ids": think_ids,
        "endpoints": results,
    }


def probe_from_config(
    config: dict[str, Any], endpoints: list[Endpoint], out: str | Path | None
) -> dict[str, Any]:
    """Probe every endpoint of the run and write probe.json."""
    target, probe = config["target"], config["probe"]
    think = target["think_tokens"]
    think_ids = think_token_ids(
        target.get("tokenizer") or target.get("path"),
        trust_remote_code=target["trust_remote_code"],
        start=think["start"],
        end=think["end"],
        start_id=think["start_id"],
        end_id=think["end_id"],
    )
    results = []
    for endpoint in endpoints:
        result = probe_endpoint(
            endpoint,
            target["model"],
            prompt=probe["prompt"],
            max_tokens=probe["max_tokens"],
            timeout_s=probe["timeout_s"],
            chat_template_kwargs=target["chat_template_kwargs"],
            extra_body=config["generation"].get("extra_body"),
            require_token_ids=probe["require_token_ids"],
            require_reasoning=probe["require_reasoning"],
        )
        log.info(
            "probe %s: reasoning in '%s', token ids %s, %.3f s",
            endpoint.url,
            result["reasoning_field"],
            result["token_ids"]["layout"] or "absent",
            result["latency_s"],
        )
        results.append(result)
    summary = summarise(results, think_ids)
    if out is not None:
        write_json(out, summary)
    return summary


def probe_run(config: dict[str, Any], out: str | Path, server_log: str | Path | None) -> dict:
    """The probe stage: open the run's endpoints (starting the embedded server if configured)."""
    with open_endpoints(config, server_log) as endpoints:
        return probe_from_config(config, endpoints, out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="model name as served")
    parser.add_argument("--api-key-env", help="environment variable holding the API key")
    parser.add_argument("--tokenizer", help="tokenizer path or name, for the think token ids")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--chat-template-kwargs", type=json.loads, default=None, help="JSON object")
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
    print(f"fields:          {result['fields']}")
    print(f"token ids:       {result['token_ids']['layout'] or 'absent'}")
    print(f"think token ids: {think_ids.get('start_id')}, {think_ids.get('end_id')}")
    print(f"finish reason:   {result['finish_reason']}; latency {result['latency_s']} s")
    print(f"reasoning:       {result['reasoning_preview']!r}")
    print(f"content:         {result['content_preview']!r}")
    return 0
