"""Per-sample lengths for the report: tokens/{shard}.lengths.parquet, one per shard.

Written by the prepare_samples job once a shard is validated and tokenized: one row per sample kept
by validation with its reasoning field and character lengths, and its token columns (null where
tokenization dropped the sample). The report reads these few numbers per sample instead of every
sample's text, and the planner resolves one input per shard for it instead of two.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from eaglenest.common.io import atomic_path

SAMPLE_LENGTH_COLUMNS = ["reasoning_field", "reasoning_chars", "content_chars"]
TOKEN_LENGTH_COLUMNS = ["n_tokens", "prompt_len", "token_source", "truncated"]
# How the sample columns are made from a samples frame, and the completion length from tokens.
CHAR_LENGTHS = [
    pl.col("reasoning").str.len_chars().alias("reasoning_chars"),
    pl.col("content").str.len_chars().alias("content_chars"),
]
COMPLETION_LEN = (pl.col("n_tokens") - pl.col("prompt_len")).alias("completion_len")


def write_shard_lengths(samples: str | Path, tokens: str | Path, out: str | Path) -> int:
    """Write the lengths file of one shard from its samples and tokens files; return its rows."""
    texts = pl.read_parquet(samples, columns=["id", "reasoning_field", "reasoning", "content"])
    frame = texts.select("id", "reasoning_field", *CHAR_LENGTHS).join(
        pl.read_parquet(tokens, columns=["id", *TOKEN_LENGTH_COLUMNS]), on="id", how="left"
    )
    with atomic_path(out) as tmp:
        frame.write_parquet(tmp)
    return frame.height


def read_shard_lengths(path: str | Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(sample lengths, token lengths) of one lengths file: every sample, and the tokenized ones
    with their completion length."""
    frame = pl.read_parquet(path, columns=[*SAMPLE_LENGTH_COLUMNS, *TOKEN_LENGTH_COLUMNS])
    samples = frame.select(SAMPLE_LENGTH_COLUMNS)
    tokens = frame.filter(pl.col("n_tokens").is_not_null()).select(TOKEN_LENGTH_COLUMNS)
    return samples, tokens.with_columns(COMPLETION_LEN)
