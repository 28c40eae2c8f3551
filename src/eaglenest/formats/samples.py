"""The samples shard, `samples/{shard}.parquet`: answers fit for training (non-empty reasoning and
content, no think tags left in either, complete, ids valid), with the prompt's messages and the
thinking mode (common/thinking.py): the switch the request sent and whether reasoning came back.
A request that switched thinking off answers without reasoning: its reasoning is empty and its
reasoning_field `none`."""

from __future__ import annotations

import pandera.polars as pa
import polars as pl
from pandera.api.polars.types import PolarsData

from eaglenest.common.reasoning import INLINE_FIELD, NO_FIELD, REASONING_FIELDS
from eaglenest.common.thinking import reasoned, request_switch
from eaglenest.formats.prompts import MESSAGE_DTYPE, PROMPT_ID_PATTERN
from eaglenest.formats.raw import RAW_SCHEMA, TOKEN_ID_COLUMNS, bad_token_ids
from eaglenest.formats.tokens import IDS_DTYPE


class SamplesSchema(pa.DataFrameModel):
    """Answers fit for training: non-empty reasoning (unless the request switched thinking off)
    and content, no think tags left in either (the parser split them), complete (not cut by
    max_tokens), unique ids."""

    id: str = pa.Field(str_matches=PROMPT_ID_PATTERN, unique=True, nullable=False)
    messages: pl.List(MESSAGE_DTYPE) = pa.Field(nullable=False)
    reasoning: str = pa.Field(nullable=False)
    content: str = pa.Field(nullable=False)
    reasoning_field: str = pa.Field(
        isin=[*REASONING_FIELDS, INLINE_FIELD, NO_FIELD], nullable=False
    )
    finish_reason: str = pa.Field(nullable=True, notin=["length"])
    prompt_token_ids: IDS_DTYPE = pa.Field(nullable=True)
    completion_token_ids: IDS_DTYPE = pa.Field(nullable=True)
    token_layout: str = pa.Field(nullable=True)
    request: str = pa.Field(nullable=False)
    endpoint: str = pa.Field(nullable=False)
    prompt_tokens: pl.Int64 = pa.Field(nullable=True, ge=0)
    completion_tokens: pl.Int64 = pa.Field(nullable=True, ge=0)
    latency_s: pl.Float64 = pa.Field(nullable=False, ge=0)
    # The chat-template switch the request sent (null: none, the template's default) and
    # whether the answer reasoned: the sample's thinking mode.
    thinking_switch: pl.Boolean = pa.Field(nullable=True)
    thinking: pl.Boolean = pa.Field(nullable=False)

    class Config:
        strict = True
        ordered = True

    @pa.check("content", error="must not be empty or whitespace")
    @classmethod
    def not_blank(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(pl.col(data.key).str.strip_chars().str.len_chars() > 0)

    @pa.dataframe_check(
        error="reasoning must not be empty or whitespace unless the request switched thinking "
        "off (thinking_switch false); `thinking` says whether it is not, reasoning_field is "
        "`none` exactly when it is"
    )
    @classmethod
    def reasoning_as_asked(cls, data: PolarsData) -> pl.LazyFrame:
        has = pl.col("reasoning").str.strip_chars().str.len_chars() > 0
        return data.lazyframe.select(
            (has | pl.col("thinking_switch").not_().fill_null(False))  # null: no switch, on
            & (pl.col("thinking") == has)
            & ((pl.col("reasoning_field") == NO_FIELD) != has)
        )

    @pa.check("reasoning", "content", error="must not contain think tags (the parser splits them)")
    @classmethod
    def no_think_tags(cls, data: PolarsData) -> pl.LazyFrame:
        tags = pl.col(data.key).str.contains("<think>", literal=True) | pl.col(
            data.key
        ).str.contains("</think>", literal=True)
        return data.lazyframe.select(tags.not_())

    @pa.check(*TOKEN_ID_COLUMNS, error="token ids must be non-null and non-negative")
    @classmethod
    def token_ids_valid(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(bad_token_ids(data.key).not_())


def samples_schema(vocab_size: int | None) -> pa.DataFrameSchema:
    """`SamplesSchema`, with every token id also below the target's `vocab_size` when known."""
    schema = SamplesSchema.to_schema()
    if vocab_size is None:
        return schema
    in_vocab = pa.Check(
        lambda data: data.lazyframe.select(bad_token_ids(data.key, vocab_size).not_()),
        error=f"token ids must be below the target's vocabulary size {vocab_size}",
    )
    return schema.update_columns(
        {c: {"checks": [*schema.columns[c].checks, in_vocab]} for c in TOKEN_ID_COLUMNS}
    )


# The thinking mode of a sample (common/thinking.py), beside the raw columns it is read from.
THINKING_COLUMNS = {"thinking_switch": pl.Boolean, "thinking": pl.Boolean}

SAMPLE_COLUMNS = [
    "id",
    "messages",
    "reasoning",
    "content",
    "reasoning_field",
    "finish_reason",
    "prompt_token_ids",
    "completion_token_ids",
    "token_layout",
    "request",
    "endpoint",
    "prompt_tokens",
    "completion_tokens",
    "latency_s",
    *THINKING_COLUMNS,
]


# Column dtypes of samples/{shard}.parquet: the raw columns kept, the prompt's messages and the
# thinking mode.
SAMPLE_SCHEMA = {
    name: pl.List(MESSAGE_DTYPE)
    if name == "messages"
    else THINKING_COLUMNS.get(name) or RAW_SCHEMA[name]
    for name in SAMPLE_COLUMNS
}


def with_thinking(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame` (raw or samples rows) with its thinking columns, computed from `request` and
    `reasoning` where absent: a samples shard written before they were recorded gets them too."""
    if all(name in frame.columns for name in THINKING_COLUMNS):
        return frame
    switches = [request_switch(r) for r in frame["request"].to_list()]
    thinking = [reasoned(r) for r in frame["reasoning"].to_list()]
    return frame.with_columns(
        pl.Series("thinking_switch", switches, dtype=pl.Boolean),
        pl.Series("thinking", thinking, dtype=pl.Boolean),
    )
