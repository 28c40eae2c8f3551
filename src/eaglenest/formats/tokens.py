"""The tokens shard, `tokens/{shard}.parquet`: the exact token sequence of every sample.

`input_ids` is the prompt then the completion; the loss covers positions from `prompt_len` on
(`loss_mask`). Pandera validates data only on collected frames: call `validate` on a
`pl.DataFrame`, not a `LazyFrame`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandera.polars as pa
import polars as pl
from pandera.api.polars.types import PolarsData

from eaglenest.formats.prompts import PROMPT_ID_PATTERN

# A list of token ids, in every file that holds them (raw, samples, tokens).
IDS_DTYPE = pl.List(pl.Int64)

TOKEN_SOURCES = ("server", "rebuilt")


class TokensSchema(pa.DataFrameModel):
    """The exact token sequence of each sample: prompt then completion (`<think>` unless the
    prompt opened it, reasoning, `</think>`, content, end of turn).

    The loss covers the completion: positions from `prompt_len` on (so at least one). `token_source`
    says whether the ids are the server's (`server`) or rebuilt with the tokenizer (`rebuilt`);
    `rebuild_agrees` whether a rebuild matched the server's ids (null when not compared);
    `truncated` whether the sequence was cut at tokenize.max_length; `thinking` the sample's
    thinking mode (it reasoned: common/thinking.py), what a drafter trained on it was trained in.
    Shards written before it was recorded lack the column: readers take it as unknown
    (`read_thinking`).
    """

    id: str = pa.Field(str_matches=PROMPT_ID_PATTERN, unique=True, nullable=False)
    input_ids: IDS_DTYPE = pa.Field(nullable=False)
    prompt_len: pl.Int64 = pa.Field(ge=0, nullable=False)
    n_tokens: pl.Int64 = pa.Field(ge=1, nullable=False)
    token_source: str = pa.Field(isin=list(TOKEN_SOURCES), nullable=False)
    truncated: bool = pa.Field(nullable=False)
    rebuild_agrees: bool = pa.Field(nullable=True)
    thinking: bool = pa.Field(nullable=False)

    class Config:
        strict = True
        ordered = True

    @pa.dataframe_check(error="n_tokens must be the length of input_ids")
    @classmethod
    def n_tokens_is_length(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(pl.col("input_ids").list.len() == pl.col("n_tokens"))

    @pa.dataframe_check(error="a sequence needs a loss token (prompt_len < n_tokens)")
    @classmethod
    def has_loss_tokens(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(pl.col("prompt_len") < pl.col("n_tokens"))

    @pa.dataframe_check(error="token ids must be non-negative")
    @classmethod
    def ids_non_negative(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select((pl.col("input_ids").list.min() >= 0).fill_null(False))


def empty_tokens_frame() -> pl.DataFrame:
    """A frame with no rows and exactly the columns and dtypes of `TokensSchema`."""
    return pl.DataFrame(
        schema={
            "id": pl.String,
            "input_ids": IDS_DTYPE,
            "prompt_len": pl.Int64,
            "n_tokens": pl.Int64,
            "token_source": pl.String,
            "truncated": pl.Boolean,
            "rebuild_agrees": pl.Boolean,
            "thinking": pl.Boolean,
        }
    )


def loss_mask(prompt_len: int, n_tokens: int) -> np.ndarray:
    """The loss mask of a sequence: 0 on the prompt, 1 from the first completion token on."""
    mask = np.zeros(n_tokens, dtype=np.int8)
    mask[prompt_len:] = 1
    return mask


def read_tokens(tokens_path: str | Path) -> pl.DataFrame:
    """What later stages need of a tokens shard: ids and where the completion starts."""
    return pl.read_parquet(tokens_path, columns=["id", "input_ids", "prompt_len", "n_tokens"])


def read_thinking(tokens_paths: list[str | Path]) -> list[bool | None]:
    """Every sample's thinking mode over tokens shards, in order; None for each sample of a shard
    written before the mode was recorded (no `thinking` column)."""
    modes: list[bool | None] = []
    for path in tokens_paths:
        names = pl.read_parquet_schema(path)
        if "thinking" in names:
            modes += pl.read_parquet(path, columns=["thinking"])["thinking"].to_list()
        else:
            modes += [None] * pl.scan_parquet(path).select(pl.len()).collect().item()
    return modes
