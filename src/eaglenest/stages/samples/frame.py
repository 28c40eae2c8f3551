"""What a shard writes: the tokens frame (TokensSchema), checked, and how often each target id is
a loss token (the vocab stage merges these counts over shards)."""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import pandera.errors
import polars as pl
import pyarrow as pa

from eaglenest.formats.token_counts import TokenCounts
from eaglenest.formats.tokens import TokensSchema, empty_tokens_frame
from eaglenest.target_model.tokenizer import TokenizeError

if TYPE_CHECKING:
    from eaglenest.target_model.special_tokens import TargetTokens

log = logging.getLogger(__name__)


def tokens_frame(rows: list[dict[str, Any]]) -> tuple[pl.DataFrame, np.ndarray, np.ndarray]:
    """The rows as a frame of `TokensSchema`, with all ids flat and the mask of loss positions
    (ids go to arrow as one array: no per-id Python objects)."""
    if not rows:
        return empty_tokens_frame(), np.zeros(0, np.int64), np.zeros(0, bool)
    lengths = np.fromiter((len(r["input_ids"]) for r in rows), dtype=np.int64, count=len(rows))
    prompt_lens = np.fromiter((r["prompt_len"] for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = np.fromiter(
        itertools.chain.from_iterable(r["input_ids"] for r in rows),
        dtype=np.int64,
        count=int(offsets[-1]),
    )
    position = np.arange(len(values)) - np.repeat(offsets[:-1], lengths)
    in_loss = position >= np.repeat(prompt_lens, lengths)
    frame = pl.DataFrame(
        {
            "id": [r["id"] for r in rows],
            "input_ids": pl.from_arrow(pa.LargeListArray.from_arrays(offsets, values)),
            "prompt_len": prompt_lens,
            "n_tokens": lengths,
            "token_source": [r["token_source"] for r in rows],
            "truncated": [r["truncated"] for r in rows],
            "rebuild_agrees": pl.Series([r["rebuild_agrees"] for r in rows], dtype=pl.Boolean),
            "thinking": pl.Series([r["thinking"] for r in rows], dtype=pl.Boolean),
        },
        schema=empty_tokens_frame().schema,
    )
    return frame, values, in_loss


def count_loss_tokens(values: np.ndarray, in_loss: np.ndarray, vocab_size: int) -> np.ndarray:
    """How often each target id is a loss token (int64 [vocab_size])."""
    loss_ids = values[in_loss]
    if loss_ids.size and (loss_ids.min() < 0 or loss_ids.max() >= vocab_size):
        raise TokenizeError(
            f"token id {int(loss_ids.max())} is outside the target vocabulary of {vocab_size} ids "
            "(tokenizer and model disagree, or the server ids come from another model)"
        )
    return np.bincount(loss_ids, minlength=vocab_size).astype(np.int64)


def check_tokens(frame: pl.DataFrame, shard: str) -> None:
    """The frame must match TokensSchema; the failing rows go to the log."""
    try:
        TokensSchema.validate(frame, lazy=True)
    except pandera.errors.SchemaErrors as err:
        log.error("tokens of shard %s failed their schema:\n%s", shard, err.failure_cases)
        raise TokenizeError(f"shard {shard}: tokens do not match their schema: {err}") from err


def loss_token_counts(tokenizer: Any, tokens: TargetTokens, loss_counts: np.ndarray) -> TokenCounts:
    """The counts with the target's special ids, and the text of those the loss uses."""
    return TokenCounts(
        loss_counts,
        np.asarray(tokens.special_ids, dtype=np.int64),
        _special_token_texts(tokenizer, tokens.special_ids, loss_counts),
    )


def _special_token_texts(tokenizer: Any, special_ids: tuple[int, ...], counts: np.ndarray) -> dict:
    used = [i for i in special_ids if counts[i] > 0]
    return dict(zip(used, tokenizer.convert_ids_to_tokens(used))) if used else {}
