"""The draft vocabulary: which target tokens the drafter can propose, chosen by frequency.

An EAGLE-3 drafter predicts over a smaller vocabulary than its target: the N target ids seen most
often where it is trained (the loss-masked tokens), with every special token that completions use
(think tags, end of turn) kept whatever its rank. The mapping is stored the way vLLM, SGLang and
the EAGLE-3 trainers read it: draft ids sorted by target id, `d2t[i] = draft_to_target[i] - i`
(int64 offsets, non-decreasing) and `t2d`, a boolean mask over the target vocabulary.

The tokenize stage writes the counts of each shard (`tokens/{shard}.counts.safetensors`, sparse:
ids seen and their counts), so building the vocabulary merges a few small files instead of
re-reading every token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from eaglenest.common.io import atomic_path, write_json
from eaglenest.formats.token_counts import TokenCounts, VocabError, merge_token_counts

if TYPE_CHECKING:
    from eaglenest.settings.vocab import VocabSettings

log = logging.getLogger(__name__)


def select_draft_vocab(counts: TokenCounts, draft_vocab_size: int) -> np.ndarray:
    """Target ids of the draft vocabulary, sorted: specials used in completions, then the most
    frequent ids (ties to the lower id); ids never seen fill any room left, lowest first."""
    size = min(draft_vocab_size, counts.target_vocab_size)
    used_specials = counts.special_ids[counts.counts[counts.special_ids] > 0]
    if len(used_specials) > size:
        raise VocabError(
            f"tokenize.draft_vocab_size {draft_vocab_size} is smaller than the "
            f"{len(used_specials)} special tokens the completions use; raise it"
        )
    ids = np.arange(counts.target_vocab_size, dtype=np.int64)
    by_frequency = np.lexsort((ids, -counts.counts))  # count descending, then id ascending
    chosen = np.zeros(counts.target_vocab_size, dtype=bool)
    chosen[used_specials] = True
    rest = by_frequency[~chosen[by_frequency]][: size - len(used_specials)]
    chosen[rest] = True
    return np.flatnonzero(chosen).astype(np.int64)


def draft_mapping(draft_to_target: np.ndarray, target_vocab_size: int) -> dict[str, np.ndarray]:
    """`d2t` (offsets: target id = i + d2t[i]) and `t2d` (mask of target ids in the draft vocab)."""
    draft_to_target = np.asarray(draft_to_target, dtype=np.int64)
    if np.any(np.diff(draft_to_target) <= 0):
        raise VocabError("draft ids must map to strictly increasing target ids")
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[draft_to_target] = True
    d2t = draft_to_target - np.arange(len(draft_to_target), dtype=np.int64)
    return {"d2t": d2t, "t2d": t2d}


def coverage(counts: np.ndarray, draft_to_target: np.ndarray) -> float:
    """Share of loss-masked tokens whose target id is in the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[draft_to_target].sum() / total) if total else 0.0


def build_draft_vocab(
    counts_paths: Iterable[str | Path],
    out: str | Path,
    summary_out: str | Path,
    settings: VocabSettings,
) -> dict[str, Any]:
    """The vocab stage: merge the shards' counts, choose the draft vocabulary, write it."""
    from safetensors.numpy import save_file

    draft_vocab_size = settings.draft_vocab_size
    counts_paths = list(counts_paths)
    counts = merge_token_counts(counts_paths)
    draft_to_target = select_draft_vocab(counts, draft_vocab_size)
    mapping = draft_mapping(draft_to_target, counts.target_vocab_size)
    seen = int(np.count_nonzero(counts.counts))
    used_specials = counts.special_ids[counts.counts[counts.special_ids] > 0]
    summary = {
        "draft_vocab_size": len(draft_to_target),
        "requested_draft_vocab_size": draft_vocab_size,
        "target_vocab_size": counts.target_vocab_size,
        "coverage": coverage(counts.counts, draft_to_target),
        "loss_tokens": int(counts.counts.sum()),
        "distinct_ids_seen": seen,
        "unseen_ids_in_draft_vocab": int(np.sum(counts.counts[draft_to_target] == 0)),
        "special_tokens_kept": {
            str(i): counts.special_tokens.get(int(i), "") for i in used_specials.tolist()
        },
        "shards": len(counts_paths),
    }
    if summary["draft_vocab_size"] == counts.target_vocab_size:
        log.info(
            "draft vocabulary = the whole target vocabulary (%d ids, asked %d): the drafter "
            "predicts target ids directly and its export ships no d2t/t2d, as vLLM expects",
            summary["draft_vocab_size"],
            draft_vocab_size,
        )
    tensors = {**mapping, "token_counts": counts.counts, "draft_to_target": draft_to_target}
    metadata = {k: json.dumps(v) for k, v in summary.items()}
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    write_json(summary_out, summary)
    log.info(
        "draft vocabulary: %d of %d target ids, coverage %.4f of %d loss tokens (%d ids seen)",
        summary["draft_vocab_size"],
        summary["target_vocab_size"],
        summary["coverage"],
        summary["loss_tokens"],
        seen,
    )
    return summary
