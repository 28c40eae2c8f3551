"""Validation: turn a raw shard into samples, and stop a shard whose reasoning is empty.

Empty reasoning is the hard stop: the original run fed 388 empty-reasoning samples onward because
nothing looked. Every other problem drops the row and counts it; a shard fails when a share of
drops is over its threshold. The message names the shard, the counts, the `reasoning_field`
values seen and what the probe found, so the fix is obvious without opening a file. A request
that switched thinking off (common/thinking.py) asked for an answer without reasoning: its empty
reasoning is kept, and the hard stop counts only the rows asked with thinking on.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandera.errors
import polars as pl

from eaglenest.common import thinking
from eaglenest.common.io import atomic_path, read_json, write_json
from eaglenest.common.reasoning import THINK_END, THINK_START
from eaglenest.formats.raw import TOKEN_ID_COLUMNS, RawSchema, bad_token_ids
from eaglenest.formats.samples import SAMPLE_COLUMNS, samples_schema, with_thinking
from eaglenest.settings.samples import ValidationSettings

log = logging.getLogger(__name__)


class ShardValidationError(RuntimeError):
    """The shard is unusable as a whole; the message says why and what the probe saw."""


def drop_reasons(
    raw: pl.DataFrame, token_ids_expected: bool, vocab_size: int | None = None
) -> pl.Series:
    """The first reason each row is dropped (null when kept), checked in order of severity."""
    has_think_tag = pl.lit(False)
    for column in ("reasoning", "content"):
        for tag in (THINK_START, THINK_END):
            has_think_tag = has_think_tag | pl.col(column).fill_null("").str.contains(
                tag, literal=True
            )
    reason = (
        pl.when(pl.col("error_kind").is_not_null())
        .then(pl.lit("request_failed:") + pl.col("error_kind"))
        # A request that switched thinking off asked for an answer without reasoning.
        .when((pl.col("reasoning").fill_null("").str.strip_chars() == "") & asked_on(raw))
        .then(pl.lit("empty_reasoning"))
        .when(pl.col("finish_reason") == "length")
        .then(pl.lit("truncated"))
        .when(pl.col("content").fill_null("").str.strip_chars() == "")
        .then(pl.lit("empty_content"))
        .when(has_think_tag)
        .then(pl.lit("think_tag_in_text"))
        .when(has_bad_token_ids(vocab_size))
        .then(pl.lit("bad_token_ids"))
        .when(pl.lit(token_ids_expected) & pl.col("completion_token_ids").is_null())
        .then(pl.lit("missing_token_ids"))
        .when(pl.col("id").is_duplicated() & (pl.int_range(pl.len()).over("id") > 0))
        .then(pl.lit("duplicate_id"))
        .otherwise(pl.lit(None, dtype=pl.String))
    )
    return raw.select(reason.alias("drop_reason")).to_series()


def asked_on(raw: pl.DataFrame) -> pl.Series:
    """Per raw row: whether its request asked for reasoning (its thinking switch is not false)."""
    off = [thinking.request_switch(r) is False for r in raw["request"].to_list()]
    return pl.Series("asked_on", [not o for o in off], dtype=pl.Boolean)


def has_bad_token_ids(vocab_size: int | None) -> pl.Expr:
    """Per raw row: ids generate could not store (`token_ids_error`), or a null id or one outside
    `[0, vocab_size)` in either list."""
    bad = pl.col("token_ids_error").is_not_null()
    for column in TOKEN_ID_COLUMNS:
        bad = bad | bad_token_ids(column, vocab_size)
    return bad


def first_bad_token_id(row: dict[str, Any], vocab_size: int | None) -> str:
    """Where a `bad_token_ids` row goes wrong first, and the value found there."""
    if row["token_ids_error"] is not None:
        return row["token_ids_error"]
    upper = vocab_size if vocab_size is not None else float("inf")
    for column in TOKEN_ID_COLUMNS:
        for index, value in enumerate(row[column] or []):
            if value is None:
                return f"{column}[{index}] is null, not an integer"
            if not 0 <= value < upper:
                valid = f"[0, {vocab_size})" if vocab_size is not None else "[0, ...)"
                return f"{column}[{index}] is {value}, outside {valid}"
    raise ValueError(f"row {row['id']} has no bad token id")


def _empty_reasoning_message(
    shard: str, n_empty: int, n_asked_on: int, raw: pl.DataFrame, probe: dict, limit: float
) -> str:
    answered = raw.filter(pl.col("error_kind").is_null())
    fields = dict(Counter(answered["reasoning_field"].to_list()))
    switched_off = answered.height - n_asked_on
    off = (
        f" (of those asked with thinking on; {switched_off} more were asked with thinking off, "
        f"{' or '.join(thinking.SWITCH_KEYS)} false in their chat_template_kwargs, and may "
        "answer without reasoning)"
        if switched_off
        else ""
    )
    return (
        f"shard {shard}: {n_empty} of {n_asked_on} answered rows have empty reasoning{off} "
        f"(> validation.max_empty_reasoning_fraction {limit}); "
        f"reasoning_field values seen: {fields}; the probe found reasoning in "
        f"'{probe.get('reasoning_field')}'. The server stopped returning reasoning for these "
        "prompts: check its reasoning parser (vLLM/SGLang `--reasoning-parser`) and "
        "target.chat_template_kwargs (to train for thinking off, set the switch false there: "
        "docs/samples.md); nothing after validation ran on this shard."
    )


def check_schema(schema: Any, frame: pl.DataFrame, what: str) -> None:
    """Validate `frame` (collected: pandera checks data only there); failure cases go to the log."""
    try:
        schema.validate(frame, lazy=True)
    except pandera.errors.SchemaErrors as err:
        log.error("%s failed its schema:\n%s", what, err.failure_cases)
        raise ShardValidationError(f"{what} does not match its schema: {err}") from err


def validate_frame(
    raw: pl.DataFrame,
    prompts: pl.DataFrame,
    probe: dict[str, Any],
    settings: ValidationSettings,
    shard: str,
    vocab_size: int | None = None,
) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Check a raw shard; return (samples, report) or raise ShardValidationError.

    `vocab_size` bounds the token ids (`target_vocab_size_of`); None checks only that they are
    non-negative."""
    check_schema(RawSchema, raw, f"shard {shard}: raw file")
    token_ids_expected = bool(probe.get("token_ids", {}).get("supported"))
    reasons = drop_reasons(raw, token_ids_expected, vocab_size)
    bad_ids = [
        {"id": row["id"], "problem": first_bad_token_id(row, vocab_size)}
        for row in raw.filter(reasons == "bad_token_ids").head(5).to_dicts()
    ]
    counts = Counter(r for r in reasons.to_list() if r is not None)
    n_answered = raw.height - sum(v for k, v in counts.items() if k.startswith("request_failed"))
    # Empty reasoning is measured against the answers asked with thinking on only.
    n_asked_on = raw.filter(asked_on(raw) & pl.col("error_kind").is_null()).height
    report = {
        "shard": shard,
        "raw_rows": raw.height,
        "answered": n_answered,
        "kept": raw.height - sum(counts.values()),
        "dropped": dict(sorted(counts.items())),
        "reasoning_fields": dict(Counter(raw["reasoning_field"].to_list())),
        "token_layouts": dict(Counter(str(v) for v in raw["token_layout"].to_list())),
        # How generation got each row: reused from the journal, or asked (new, retry, or because
        # the request changed); see formats.raw.ROW_ORIGINS.
        "origins": dict(Counter(str(v) for v in raw["origin"].to_list())),
        "thresholds": asdict(settings),
        "probe_reasoning_field": probe.get("reasoning_field"),
        "vocab_size": vocab_size,
        "bad_token_ids": bad_ids,  # the first few rows dropped for them, and why
    }
    share = lambda n: n / n_answered if n_answered else 0.0
    n_empty = counts["empty_reasoning"]
    if n_asked_on and n_empty / n_asked_on > settings.max_empty_reasoning_fraction:
        raise ShardValidationError(
            _empty_reasoning_message(
                shard,
                n_empty,
                n_asked_on,
                raw,
                probe,
                settings.max_empty_reasoning_fraction,
            )
        )
    if n_answered and share(counts["truncated"]) > settings.max_truncated_fraction:
        raise ShardValidationError(
            f"shard {shard}: {counts['truncated']} of {n_answered} answers hit max_tokens "
            f"(finish_reason 'length', > validation.max_truncated_fraction "
            f"{settings.max_truncated_fraction}); raise generation.max_tokens"
        )
    max_bad_ids = settings.max_bad_token_ids_fraction
    if n_answered and share(counts["bad_token_ids"]) > max_bad_ids:
        raise ShardValidationError(
            f"shard {shard}: {counts['bad_token_ids']} of {n_answered} answered rows have bad "
            f"token ids (> validation.max_bad_token_ids_fraction {max_bad_ids}); first: row "
            f"{bad_ids[0]['id']}: {bad_ids[0]['problem']}. The server's answer is kept in the "
            "raw file's `response` column; check that the server returns integer ids of the "
            "model at target.path (same tokenizer and vocabulary)."
        )
    kept = with_thinking(raw.with_columns(reasons).filter(pl.col("drop_reason").is_null()))
    # The kept samples' thinking mode: the switch their requests sent, whether they reasoned.
    report["thinking"] = thinking.summary(kept["thinking_switch"], kept["thinking"])
    samples = kept.join(prompts.select("id", "messages"), on="id", how="left").select(
        SAMPLE_COLUMNS
    )
    missing = samples.filter(pl.col("messages").is_null())["id"].to_list()
    if missing:
        raise ShardValidationError(f"shard {shard}: ids not in the prompts shard: {missing[:5]}")
    check_schema(samples_schema(vocab_size), samples, f"shard {shard}: samples")
    return samples, report


def validate_shard(
    raw: str | Path,
    prompts: str | Path,
    probe: str | Path,
    samples_out: str | Path,
    report_out: str | Path,
    settings: ValidationSettings,
    shard: str,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """The validate stage for one shard: samples/{shard}.parquet and its report."""
    samples, report = validate_frame(
        pl.read_parquet(raw),
        pl.read_parquet(prompts),
        read_json(probe),
        settings,
        shard,
        vocab_size,
    )
    log.info(
        "shard %s: kept %d of %d; dropped %s",
        shard,
        report["kept"],
        report["raw_rows"],
        report["dropped"],
    )
    with atomic_path(samples_out) as tmp:
        samples.write_parquet(tmp)
    write_json(report_out, report)
    return report
