"""Rows and frames of the files between stages, as tests make them: prompt frames, raw answers
and validated samples (the schemas of eaglenest.formats)."""

from __future__ import annotations

import hashlib
import json

import polars as pl

from eaglenest.common.thinking import reasoned, switch_value
from eaglenest.formats.raw import RAW_SCHEMA
from eaglenest.formats.samples import SAMPLE_SCHEMA, SamplesSchema


def prompt_frame(n: int, tag: str = "p") -> pl.DataFrame:
    """`n` one-turn prompts as the prompts stage writes them, ids their content hashes."""
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"{tag} question {i}"}]
        rows.append(
            {
                "id": hashlib.sha256(json.dumps(messages).encode()).hexdigest()[:16],
                "messages": messages,
                "source": "test",
                "source_index": i,
            }
        )
    return pl.DataFrame(rows)


def raw_row(sample_id: str, **overrides) -> dict:
    """A raw answer that passes validation (vLLM token ids), with `overrides` over it."""
    row = dict.fromkeys(RAW_SCHEMA)
    row.update(
        id=sample_id,
        endpoint="http://127.0.0.1:1",
        request="{}",
        response="{}",
        reasoning="\nthink\n",
        content="\n\n42",
        reasoning_field="reasoning",
        finish_reason="stop",
        prompt_token_ids=[1, 2],
        completion_token_ids=[3, 4],
        token_layout="vllm",
        prompt_tokens=2,
        completion_tokens=2,
        latency_s=0.1,
        attempts=1,
    )
    row.update(overrides)
    return row


def sample_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sample(
    prompt: str,
    reasoning: str,
    content: str,
    *,
    history: list[dict] | None = None,
    kwargs: dict | None = None,
    prompt_token_ids: list[int] | None = None,
    completion_token_ids: list[int] | None = None,
) -> dict:
    messages = [*(history or []), {"role": "user", "content": prompt}]
    request = {"messages": messages, "model": "m"}
    if kwargs is not None:
        request["chat_template_kwargs"] = kwargs
    return {
        "id": sample_id(json.dumps(messages) + reasoning + content),
        "messages": messages,
        "reasoning": reasoning,
        "content": content,
        "reasoning_field": "reasoning" if reasoned(reasoning) else "none",  # none: thinking off
        "finish_reason": "stop",
        "prompt_token_ids": prompt_token_ids,
        "completion_token_ids": completion_token_ids,
        "token_layout": "vllm" if completion_token_ids is not None else None,
        "request": json.dumps(request, sort_keys=True),
        "endpoint": "http://127.0.0.1:1",
        "prompt_tokens": None,
        "completion_tokens": None,
        "latency_s": 0.1,
        "thinking_switch": switch_value(kwargs),
        "thinking": reasoned(reasoning),
    }


def samples_frame(rows: list[dict]) -> pl.DataFrame:
    """`sample` rows as the validate stage writes them (its schema checked)."""
    frame = pl.DataFrame(
        rows,
        schema=SAMPLE_SCHEMA,
    )
    return SamplesSchema.validate(frame)  # the tests feed what the validate stage writes
