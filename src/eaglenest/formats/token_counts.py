"""Token counts per shard, `tokens/{shard}.counts.safetensors`: how often each target id occurs
in the loss-masked positions; the draft vocabulary is built from their sum."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eaglenest.common.io import atomic_path


class VocabError(RuntimeError):
    """The counts cannot make a draft vocabulary; the message says which file or setting."""


COUNTS_FORMAT = "eaglenest-token-counts-1"


@dataclass
class TokenCounts:
    """Loss-masked token counts over the whole target vocabulary, and the target's special ids."""

    counts: np.ndarray  # int64 [target_vocab_size]
    special_ids: np.ndarray  # int64, sorted: added and special tokens of the target tokenizer
    special_tokens: dict[int, str] = field(default_factory=dict)  # text of the used ones

    @property
    def target_vocab_size(self) -> int:
        return int(self.counts.shape[0])


def write_token_counts(path: str | Path, counts: TokenCounts, shard: str = "") -> None:
    """Write counts sparsely (only ids seen), with what the vocab stage needs to merge them."""
    from safetensors.numpy import save_file

    seen = np.flatnonzero(counts.counts).astype(np.int64)
    used_specials = {i: t for i, t in counts.special_tokens.items() if counts.counts[i] > 0}
    metadata = {
        "format": COUNTS_FORMAT,
        "shard": shard,
        "target_vocab_size": str(counts.target_vocab_size),
        "special_tokens": json.dumps({str(i): t for i, t in sorted(used_specials.items())}),
    }
    tensors = {
        "token_ids": seen,
        "counts": counts.counts[seen].astype(np.int64),
        "special_ids": np.asarray(counts.special_ids, dtype=np.int64),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def read_token_counts(path: str | Path) -> TokenCounts:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as stream:
        metadata = stream.metadata() or {}
        if metadata.get("format") != COUNTS_FORMAT:
            raise VocabError(f"{path} is not a token-counts file ({COUNTS_FORMAT})")
        token_ids = stream.get_tensor("token_ids")
        values = stream.get_tensor("counts")
        special_ids = stream.get_tensor("special_ids")
    counts = np.zeros(int(metadata["target_vocab_size"]), dtype=np.int64)
    counts[token_ids] = values
    specials = {int(i): t for i, t in json.loads(metadata["special_tokens"]).items()}
    return TokenCounts(counts, np.sort(special_ids), specials)


def merge_token_counts(paths: Iterable[str | Path]) -> TokenCounts:
    """Sum the counts of every shard; all shards must come from the same target tokenizer."""
    merged: TokenCounts | None = None
    first = None
    for path in paths:
        shard = read_token_counts(path)
        if merged is None:
            merged, first = shard, path
            continue
        if shard.target_vocab_size != merged.target_vocab_size or not np.array_equal(
            shard.special_ids, merged.special_ids
        ):
            raise VocabError(
                f"{path} and {first} were tokenized with different target vocabularies "
                f"({shard.target_vocab_size} vs {merged.target_vocab_size} ids, or other special "
                "tokens); rerun the tokenize stage for every shard"
            )
        merged.counts += shard.counts
        merged.special_tokens.update(shard.special_tokens)
    if merged is None:
        raise VocabError("no token-count files to merge (no shards)")
    return merged
