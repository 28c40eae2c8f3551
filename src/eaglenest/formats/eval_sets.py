"""An evaluation set as the pipeline reads it, `eval_sets/{set}.parquet`: one prompt per row, its
user turns in order (a multi-turn set keeps every turn; the target answers each in turn, its own
earlier answers between them). Written by the rule prepare_eval_set from a standard set's local
file (eaglenest.stages.eval_sets); the evaluate stage reads it through `read_eval_set`.
Pandera validates data only on collected frames."""

from __future__ import annotations

import pandera.polars as pa
import polars as pl
from pandera.api.polars.types import PolarsData

EVAL_SET_COLUMNS = {
    "set": pl.String,
    "id": pl.String,
    "category": pl.String,
    "system": pl.String,
    "turns": pl.List(pl.String),
    "source_row": pl.Int64,
}


class EvalSetSchema(pa.DataFrameModel):
    """One prompt of a standard set per row.

    `id` is the set's own id (MT-Bench's question_id, HumanEval's task_id, the row number where
    the set has none), unique within the set; `category` the set's own (MT-Bench's writing, math
    ...) or the one the set is about (GSM8K math, HumanEval coding); `system` a system prompt the
    row carried (null: none); `turns` the user messages; `source_row` where the row is in the
    file (JSON Lines: its line, from 1; parquet: its row, from 0)."""

    set: str = pa.Field(nullable=False)
    id: str = pa.Field(unique=True, nullable=False, str_length={"min_value": 1})
    category: str = pa.Field(nullable=False, str_length={"min_value": 1})
    system: str = pa.Field(nullable=True)
    turns: pl.List(pl.String) = pa.Field(nullable=False)
    source_row: pl.Int64 = pa.Field(ge=0, nullable=False)

    class Config:
        strict = True  # no extra columns: the evaluate stage relies on exactly this layout
        ordered = True

    @pa.dataframe_check(error="every row needs at least one turn, each a non-empty string")
    @classmethod
    def turns_present(cls, data: PolarsData) -> pl.LazyFrame:
        turns = pl.col("turns")
        filled = turns.list.eval(pl.element().str.strip_chars().str.len_chars() > 0).list.all()
        return data.lazyframe.select((turns.list.len() > 0) & filled.fill_null(False))

    @pa.dataframe_check(error="a file holds one set: every row's `set` is the same")
    @classmethod
    def one_set(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(pl.col("set") == pl.col("set").first())


def eval_set_frame(rows: list[dict]) -> pl.DataFrame:
    """The rows (dicts of EVAL_SET_COLUMNS) as a frame of exactly the schema's columns, validated."""
    frame = pl.DataFrame(rows, schema=EVAL_SET_COLUMNS)
    return EvalSetSchema.validate(frame, lazy=True)


def read_eval_set(path: str) -> pl.DataFrame:
    """An `eval_sets/{set}.parquet`, validated: what the evaluate stage decodes."""
    return EvalSetSchema.validate(pl.read_parquet(path), lazy=True)
