"""The raw shard, `raw/{shard}.parquet`: one row per prompt, the answer as the server sent it or
the terminal failure of its request, with the field that carried the reasoning and the token ids.

The writer checks every id before it reaches the typed Int64 list columns (a string id would crash
the shard, a float would be silently cut): a row with unusable ids keeps them only in `response`
and says why in `token_ids_error`."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandera.polars as pa
import polars as pl
from pandera.api.polars.types import PolarsData

from eaglenest.common.io import atomic_path
from eaglenest.formats.prompts import PROMPT_ID_PATTERN
from eaglenest.formats.response_ids import TokenIds, token_ids_problem
from eaglenest.formats.tokens import IDS_DTYPE

log = logging.getLogger(__name__)


TOKEN_ID_COLUMNS = ("prompt_token_ids", "completion_token_ids")


def bad_token_ids(column: str, vocab_size: int | None = None) -> pl.Expr:
    """Per row: does the id list hold a null or an id outside `[0, vocab_size)` (only `>= 0` when
    the vocabulary is unknown)? False for a null list: a missing list is not a bad id."""
    bad = pl.element().is_null() | (pl.element() < 0)
    if vocab_size is not None:
        bad = bad | (pl.element() >= vocab_size)
    return pl.col(column).list.eval(bad).list.any().fill_null(False)


# journal: an answer to the same request, reused; the others were asked in the run that wrote the
# file: new (never asked), retry (only failures before), settings_changed (answered before, but
# for a request the current settings no longer send).
ROW_ORIGINS = ("journal", "new", "retry", "settings_changed")


class RawSchema(pa.DataFrameModel):
    """One row per prompt of the shard: the answer, or the terminal failure of its request.

    Rows are not judged here (validation does that); this fixes the layout: every prompt has a
    row, failures say why, and answered rows say which field carried the reasoning.
    """

    id: str = pa.Field(str_matches=PROMPT_ID_PATTERN, nullable=False)
    endpoint: str = pa.Field(nullable=True)
    request: str = pa.Field(nullable=False)
    response: str = pa.Field(nullable=True)
    reasoning: str = pa.Field(nullable=True)
    content: str = pa.Field(nullable=True)
    reasoning_field: str = pa.Field(
        isin=["reasoning", "reasoning_content", "content_think_tags", "none"], nullable=False
    )
    finish_reason: str = pa.Field(nullable=True)
    prompt_token_ids: IDS_DTYPE = pa.Field(nullable=True)
    completion_token_ids: IDS_DTYPE = pa.Field(nullable=True)
    token_layout: str = pa.Field(nullable=True)
    token_ids_error: str = pa.Field(nullable=True)
    prompt_tokens: pl.Int64 = pa.Field(nullable=True, ge=0)
    completion_tokens: pl.Int64 = pa.Field(nullable=True, ge=0)
    latency_s: pl.Float64 = pa.Field(nullable=False, ge=0)
    slot_wait_s: pl.Float64 = pa.Field(nullable=True, ge=0)
    attempts: pl.Int64 = pa.Field(nullable=False, ge=1)
    error_kind: str = pa.Field(nullable=True)
    error: str = pa.Field(nullable=True)
    # Where the row came from: reused from the journal, or asked in this run and why.
    origin: str = pa.Field(isin=list(ROW_ORIGINS), nullable=True)

    class Config:
        strict = True

    @pa.dataframe_check(error="a row has a response or an error, never both or neither")
    @classmethod
    def answer_or_error(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(
            pl.col("response").is_null() == pl.col("error_kind").is_not_null()
        )

    @pa.dataframe_check(error="a row whose token ids are unusable (token_ids_error) has no ids")
    @classmethod
    def unusable_ids_are_null(cls, data: PolarsData) -> pl.LazyFrame:
        ids_null = pl.col("prompt_token_ids").is_null() & pl.col("completion_token_ids").is_null()
        return data.lazyframe.select(pl.col("token_ids_error").is_null() | ids_null)


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
    "token_ids_error": pl.String,  # why the server's ids were unusable (then both ids are null)
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "latency_s": pl.Float64,  # the answering attempt's time in flight (slot held)
    "slot_wait_s": pl.Float64,  # waits for an endpoint slot, all attempts (null: older journals)
    "attempts": pl.Int64,
    "error_kind": pl.String,
    "error": pl.String,
    "origin": pl.String,  # see ROW_ORIGINS
}


def checked_token_ids(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with its ids nulled and `token_ids_error` set when an id is not an integer.

    The raw file's id columns are Int64 lists, which would crash on a string id and silently
    coerce a float or huge one; the ids the server sent stay readable in `response`, and
    validation drops the row as `bad_token_ids`.
    """
    ids = TokenIds(
        record["token_layout"], record["prompt_token_ids"], record["completion_token_ids"]
    )
    problem = token_ids_problem(ids)
    if problem is None:
        return record
    log.warning("%s: unusable token ids from %s: %s", record["id"], record["endpoint"], problem)
    return record | {
        "prompt_token_ids": None,
        "completion_token_ids": None,
        "token_ids_error": problem,
    }


def write_raw(records: Iterable[dict[str, Any]], out: str | Path) -> None:
    # Checked again: journals written before the check hold ids exactly as the server sent them.
    frame = pl.DataFrame([checked_token_ids(r) for r in records], schema=RAW_SCHEMA)
    with atomic_path(out) as tmp:
        frame.write_parquet(tmp)
