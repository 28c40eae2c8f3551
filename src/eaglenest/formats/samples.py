"""The samples shard, `samples/{shard}.parquet`: answers fit for training (non-empty reasoning and
content, no think tags left in either, complete, ids valid), with the prompt's messages."""

from __future__ import annotations

import pandera.polars as pa
import polars as pl
from pandera.api.polars.types import PolarsData

from eaglenest.formats.prompts import MESSAGE_DTYPE, PROMPT_ID_PATTERN
from eaglenest.formats.raw import RAW_SCHEMA, TOKEN_ID_COLUMNS, bad_token_ids
from eaglenest.formats.tokens import IDS_DTYPE


class SamplesSchema(pa.DataFrameModel):
    """Answers fit for training: non-empty reasoning and content, no think tags left in either
    (the parser split them), complete (not cut by max_tokens), unique ids."""

    id: str = pa.Field(str_matches=PROMPT_ID_PATTERN, unique=True, nullable=False)
    messages: pl.List(MESSAGE_DTYPE) = pa.Field(nullable=False)
    reasoning: str = pa.Field(nullable=False)
    content: str = pa.Field(nullable=False)
    reasoning_field: str = pa.Field(
        isin=["reasoning", "reasoning_content", "content_think_tags"], nullable=False
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

    class Config:
        strict = True
        ordered = True

    @pa.check("reasoning", "content", error="must not be empty or whitespace")
    @classmethod
    def not_blank(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(pl.col(data.key).str.strip_chars().str.len_chars() > 0)

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
]


# Column dtypes of samples/{shard}.parquet: the raw columns kept, plus the prompt's messages.
SAMPLE_SCHEMA = {
    name: pl.List(MESSAGE_DTYPE) if name == "messages" else RAW_SCHEMA[name]
    for name in SAMPLE_COLUMNS
}
