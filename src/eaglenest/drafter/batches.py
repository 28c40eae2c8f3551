"""Training data for the drafter: memory-mapped hidden shards in token-budget batches, and the
target's distribution over the draft vocabulary at every position.

Nothing is loaded whole: a batch reads its samples' rows from the shard files (safetensors
`get_slice`, see formats/hidden_shard.py) when it is built. The order is a function of (seed, epoch), so
a resumed run builds exactly the batches the killed run would have built. `train.sequence` decides
which rows of a sample are read, at which positions (eaglenest.drafter.views): batches are formed
by the viewed lengths.

The target signal is either the target's final normed hidden state (logits = head(final), computed
here a chunk of rows at a time) or the stored top-k logits; either way the loss sees the target's
logits restricted to the draft vocabulary and a flag saying whether the target's argmax lies in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from eaglenest.common.batching import pack_batches, packed_batches, packed_rows, pooled_batches
from eaglenest.drafter.views import sample_view, viewed_length, window_draws
from eaglenest.formats.hidden_shard import HiddenShard, open_hidden_shard

if TYPE_CHECKING:  # annotations only: the batches never load a head or a vocabulary
    from eaglenest.formats.draft_vocab import DraftVocab
    from eaglenest.formats.target_head import TargetHead
    from eaglenest.settings.train import SequenceSettings

HEAD_CHUNK_ROWS = 2048


class TrainDataError(ValueError):
    """Hidden shards, target head and draft vocab disagree; the message names the file."""


@dataclass
class Batch:
    aux: torch.Tensor  # [B, T, n·H] float32: the n layers the drafter reads, side by side
    input_ids: torch.Tensor  # [B, T] int64 (0 past each sample's end)
    loss_mask: torch.Tensor  # [B, T] bool (False past the end)
    # [B, T, D] float32 (TargetSignal): the target's log-probabilities of the draft tokens under
    # its full-vocabulary softmax, so exp() is each draft token's share of all the mass and a
    # softmax over D renormalises to the draft vocabulary. With top-k storage the "full" softmax
    # is that of the k stored logits. -inf for a draft token the top-k did not keep.
    target_logits: torch.Tensor | None
    in_draft_vocab: torch.Tensor | None  # [B, T] bool: the target's argmax is a draft token
    samples: list[tuple[str, int]]  # (shard file name, sample index)
    # What the target signal is computed from (on the training device), one of:
    final_hidden: torch.Tensor | None = None  # [B, T, H]
    topk_ids: torch.Tensor | None = None  # [B, T, k]
    topk_values: torch.Tensor | None = None  # [B, T, k]
    token_mask: torch.Tensor | None = None  # [B, T] bool: each sample's tokens, prompt included
    # [B, T] int64, rows that pack several samples (`build_packed_batch`): the sample of its row
    # each position holds (0, 1, ...; -1 past the row's end). None: one sample a row.
    segments: torch.Tensor | None = None
    # [B, T] int64: each position's rotary position, where a view (train.sequence) kept rows
    # apart from a sample's start (0 past a row's end). None: from 0 in each sample.
    positions: torch.Tensor | None = None

    TENSORS = (
        "aux",
        "input_ids",
        "loss_mask",
        "target_logits",
        "in_draft_vocab",
        "final_hidden",
        "topk_ids",
        "topk_values",
        "token_mask",
        "segments",
        "positions",
    )

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: str | torch.device) -> Batch:
        moved = {
            name: None if getattr(self, name) is None else getattr(self, name).to(device)
            for name in self.TENSORS
        }
        return Batch(**moved, samples=self.samples)


def open_shards(
    paths: list[str | Path],
    head: TargetHead,
    vocab: DraftVocab,
    tokens: list[str | Path] | None = None,
) -> list[HiddenShard]:
    """Open every shard, checking layer ids and sizes against the target head and draft vocab,
    and, given the tokens shard of each, that it was computed from that file."""
    shards = [
        open_hidden_shard(
            p,
            expect_layer_ids=head.aux_layer_ids,
            expect_hidden_size=head.hidden_size,
            expect_tokens=None if tokens is None else tokens[i],
        )
        for i, p in enumerate(paths)
    ]
    if len(vocab.t2d) != head.vocab_size:
        raise TrainDataError(
            f"draft vocab t2d covers {len(vocab.t2d)} target ids but the target head "
            f"{head.path} has vocab_size {head.vocab_size}"
        )
    return shards


def aux_columns(
    captured: Sequence[int], reads: Sequence[int], hidden_size: int
) -> torch.Tensor | None:
    """The columns of a shard's `aux` [T, n·H] (the captured layers' states side by side, in the
    captured order) that hold the layers a drafter reads, in the order it reads them; None where
    it reads every captured layer (nothing to slice). TrainDataError for a layer not captured."""
    captured, reads = list(captured), list(reads)
    if reads == captured:
        return None
    missing = [i for i in reads if i not in captured]
    if missing:
        raise TrainDataError(f"the drafter reads layers {missing}, not captured ({captured})")
    starts = [captured.index(i) * hidden_size for i in reads]
    return torch.cat([torch.arange(start, start + hidden_size) for start in starts])


class TargetSignal:
    """Target log-probabilities of the draft tokens (`Batch.target_logits`) and whether the
    full-vocab argmax is a draft token, computed on the training device: for a large vocabulary
    this is a real matmul."""

    def __init__(self, head: TargetHead, vocab: DraftVocab, device: str | torch.device = "cpu"):
        self.head = head.lm_head.to(device, torch.float32)
        self.draft_ids = vocab.draft_ids.to(device)
        self.t2d = vocab.t2d.to(device)
        self.target_to_draft = vocab.target_to_draft.to(device)

    def from_final_hidden(self, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Written in place, chunk by chunk: each extra [rows, D] tensor (a difference, a
        # concatenation) cost about as much as the gather itself.
        logits = final.new_empty((final.shape[0], len(self.draft_ids)), dtype=torch.float32)
        in_vocab = torch.empty(final.shape[0], dtype=torch.bool, device=final.device)
        for start in range(0, final.shape[0], HEAD_CHUNK_ROWS):
            rows = slice(start, start + HEAD_CHUNK_ROWS)
            full = final[rows].float() @ self.head.T
            torch.index_select(full, 1, self.draft_ids, out=logits[rows])
            logits[rows].sub_(full.logsumexp(-1, keepdim=True))
            in_vocab[rows] = self.t2d[full.argmax(-1)]
        return logits, in_vocab

    def from_topk(
        self, ids: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = ids.long()
        logits = torch.full(
            (ids.shape[0], len(self.draft_ids)), float("-inf"), device=values.device
        )
        draft = self.target_to_draft[ids]
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        keep = draft >= 0
        values = values.float()
        logits[rows[keep], draft[keep]] = (values - values.logsumexp(-1, keepdim=True))[keep]
        best = ids.gather(1, values.argmax(-1, keepdim=True))[:, 0]
        return logits, self.t2d[best]

    def fill(self, batch: Batch) -> Batch:
        """The batch with target_logits and in_draft_vocab set (on the batch's device)."""
        b, t = batch.input_ids.shape
        if batch.final_hidden is not None:
            logits, in_vocab = self.from_final_hidden(batch.final_hidden.reshape(b * t, -1))
        else:
            k = batch.topk_ids.shape[-1]
            logits, in_vocab = self.from_topk(
                batch.topk_ids.reshape(b * t, k), batch.topk_values.reshape(b * t, k)
            )
        batch.target_logits = logits.reshape(b, t, -1)
        batch.in_draft_vocab = in_vocab.reshape(b, t)
        return batch


@dataclass(frozen=True)
class SampleRef:
    shard: int
    index: int
    length: int  # the rows it trains on (its view's, `viewed_length`)
    draw: int = 0  # where its window lies this epoch (views.sample_view), train.sequence windows


class BatchPlan:
    """Which samples go into which batch, in which order, for every epoch.

    `shuffle_pool` 0: the same length-sorted batches every epoch, in a new order. Above 0: new
    batches every epoch (`pooled_batches`: random pools of that many batches' worth of tokens,
    length-sorted within), so an epoch's batch count can differ a little from the next's.
    `packed`: new batches of samples in a random order every epoch, lengths mixed, several
    samples a row (`packed_batches`, `build_packed_batch`); shuffle_pool does not apply.
    `sequence` (train.sequence; None: whole samples): the rows of each sample read, the
    lengths the batches are formed by, and each epoch's window draws (`epoch_order`)."""

    def __init__(
        self,
        shards: list[HiddenShard],
        max_batch_tokens: int,
        seed: int,
        limit: int | None = None,
        shuffle_pool: int = 0,
        packed: bool = False,
        aux_layer_ids: Sequence[int] | None = None,
        sequence: SequenceSettings | None = None,
    ):
        self.shards = shards
        self.sequence = sequence
        # The captured layers the drafter reads (its config's aux_layer_ids): the batches' aux
        # holds their columns only (`aux_columns`); None: every captured layer.
        self.aux_layer_ids = aux_layer_ids
        self.seed = seed
        self.max_batch_tokens = max_batch_tokens
        self.shuffle_pool = shuffle_pool
        self.packed = packed
        self.refs = [
            SampleRef(s, i, viewed_length(sequence, int(shard.offsets[i + 1] - shard.offsets[i])))
            for s, shard in enumerate(shards)
            for i in range(len(shard))
        ][:limit]
        self.lengths = np.array([r.length for r in self.refs], dtype=np.int64)
        # Length-sorted batches waste little padding; the order of batches is shuffled per epoch.
        self.batches = pack_batches(self.lengths, max_batch_tokens)

    def __len__(self) -> int:
        """Batches of epoch 0 (of every epoch when shuffle_pool is 0)."""
        return len(self._epoch_batches(0))

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """Indices into `refs`, batch by batch, of that epoch."""
        rng = np.random.default_rng([self.seed, epoch])
        if self.packed:
            return packed_batches(self.lengths, self.max_batch_tokens, rng)
        if self.shuffle_pool:
            return pooled_batches(self.lengths, self.max_batch_tokens, self.shuffle_pool, rng)
        return [self.batches[b] for b in rng.permutation(len(self.batches))]

    def epoch_order(self, epoch: int) -> list[list[SampleRef]]:
        """The epoch's batches; with windows, each sample with this epoch's draw."""
        refs = self.refs
        if self.sequence is not None and self.sequence.mode == "windows":
            draws = window_draws(self.seed, epoch, len(refs)).tolist()
            refs = [replace(ref, draw=draw) for ref, draw in zip(refs, draws, strict=True)]
        return [[refs[i] for i in batch] for batch in self._epoch_batches(epoch)]

    def epoch_sizes(self, epochs: int) -> list[int]:
        """Batches in each of the first `epochs` epochs."""
        if not (self.shuffle_pool or self.packed):
            return [len(self.batches)] * epochs
        return [len(self._epoch_batches(epoch)) for epoch in range(epochs)]


def build_batch(
    refs: list[SampleRef],
    shards: list[HiddenShard],
    aux_layer_ids: Sequence[int] | None = None,
    sequence: SequenceSettings | None = None,
) -> Batch:
    """Right-padded tensors of these samples, read from the shard files (target signal raw);
    `aux_layer_ids`: the captured layers the drafter reads (BatchPlan's), None: all;
    `sequence`: the rows of each sample read, at their positions (BatchPlan's), None: all."""
    longest = max(r.length for r in refs)
    views = [ref_view(r, shards[r.shard], sequence) for r in refs]
    samples = [
        drafter_sample(shards[r.shard], r.index, aux_layer_ids, None if v is None else v.spans())
        for r, v in zip(refs, views, strict=True)
    ]
    for ref, view, sample in zip(refs, views, samples, strict=True):
        if view is not None and view.seam_row is not None:  # the token after the sink (views.py)
            row = view.seam_row
            after_sink = shards[ref.shard].sample(ref.index, [(row, row + 1)])["input_ids"]
            ids = sample["input_ids"].clone()
            ids[row] = after_sink[0]
            sample["input_ids"] = ids

    def padded(name: str, dtype: torch.dtype) -> torch.Tensor:
        first = samples[0][name]
        out = torch.zeros((len(refs), longest, *first.shape[1:]), dtype=dtype)
        for row, (ref, sample) in enumerate(zip(refs, samples, strict=True)):
            out[row, : ref.length] = sample[name].to(dtype)
        return out

    has_final = "final_hidden" in samples[0]
    return Batch(
        aux=padded("aux", torch.float32),
        input_ids=padded("input_ids", torch.long),
        loss_mask=padded("loss_mask", torch.bool),
        target_logits=None,
        in_draft_vocab=None,
        samples=[(shards[r.shard].path.name, r.index) for r in refs],
        final_hidden=padded("final_hidden", torch.float32) if has_final else None,
        topk_ids=None if has_final else padded("topk_ids", torch.long),
        topk_values=None if has_final else padded("topk_values", torch.float32),
        token_mask=torch.arange(longest)[None, :] < torch.tensor([r.length for r in refs])[:, None],
        positions=view_positions(views, [r.length for r in refs], longest),
    )


def ref_view(ref: SampleRef, shard: HiddenShard, sequence: SequenceSettings | None):
    """The sample's view (views.sample_view; None: whole), its prompt read only where needed."""
    n = int(shard.offsets[ref.index + 1] - shard.offsets[ref.index])
    if sequence is None or n <= sequence.length or sequence.mode == "whole":
        return None
    prompt_len = shard.prompt_len(ref.index) if sequence.mode == "windows" else 0
    return sample_view(sequence, n, prompt_len, ref.draw)


def view_positions(views: list, lengths: list[int], width: int) -> torch.Tensor | None:
    """[B, width] rotary positions of the rows (0 past each one's end); None where no sample
    has a view (every row from 0, as the models count by default)."""
    if all(view is None for view in views):
        return None
    positions = torch.zeros((len(views), width), dtype=torch.long)
    for row, (view, n) in enumerate(zip(views, lengths, strict=True)):
        positions[row, :n] = torch.arange(n) if view is None else view.positions()
    return positions


def batch_positions(batch: Batch) -> torch.Tensor:
    """[B, T] the rotary position of every position of the batch: its own, or from 0 in each
    sample (restarting at each sample of a packed row)."""
    if batch.positions is not None:
        return batch.positions
    b, t = batch.input_ids.shape
    positions = torch.arange(t, device=batch.input_ids.device).expand(b, t)
    if batch.segments is None:
        return positions
    starts = torch.ones_like(batch.segments, dtype=torch.bool)
    starts[:, 1:] = batch.segments[:, 1:] != batch.segments[:, :-1]
    return positions - torch.where(starts, positions, 0).cummax(-1).values


def drafter_sample(
    shard: HiddenShard,
    index: int,
    aux_layer_ids: Sequence[int] | None,
    spans: list[tuple[int, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """A shard's sample (its `spans`' rows; None: all) with `aux` cut to the columns of the
    layers the drafter reads."""
    sample = shard.sample(index) if spans is None else shard.sample(index, spans)
    if aux_layer_ids is None:
        return sample
    columns = aux_columns(shard.aux_layer_ids, aux_layer_ids, shard.hidden_size)
    return sample if columns is None else {**sample, "aux": sample["aux"][:, columns]}


def build_packed_batch(
    refs: list[SampleRef],
    shards: list[HiddenShard],
    max_batch_tokens: int,
    aux_layer_ids: Sequence[int] | None = None,
    sequence: SequenceSettings | None = None,
) -> Batch:
    """The samples packed into rows (`packed_rows` under max_batch_tokens), each row the
    concatenation of its samples, right-padded; `segments` says which sample each position
    holds (and `positions`, where a view set them, their positions). Training on it equals
    training on `build_batch` of the same samples."""
    rows = packed_rows([r.length for r in refs], max_batch_tokens)
    batch = build_batch(refs, shards, aux_layer_ids, sequence)  # a sample a row, then packed
    if len(rows) == len(refs):  # nothing shares a row (long samples): linear-memory attention
        return batch
    width = max(sum(refs[i].length for i in row) for row in rows)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    packed: dict[str, torch.Tensor] = {}
    for name in (
        "aux",
        "input_ids",
        "loss_mask",
        "final_hidden",
        "topk_ids",
        "topk_values",
        "token_mask",
        "positions",
    ):
        rowwise = getattr(batch, name)
        if rowwise is None:
            continue
        out = rowwise.new_zeros((len(rows), width, *rowwise.shape[2:]))
        for r, row in enumerate(rows):
            at = 0
            for s, i in enumerate(row):
                n = refs[i].length
                out[r, at : at + n] = rowwise[i, :n]
                segments[r, at : at + n] = s
                at += n
        packed[name] = out
    order = [i for row in rows for i in row]
    return Batch(
        aux=packed["aux"],
        input_ids=packed["input_ids"],
        loss_mask=packed["loss_mask"],
        target_logits=None,
        in_draft_vocab=None,
        samples=[batch.samples[i] for i in order],
        final_hidden=packed.get("final_hidden"),
        topk_ids=packed.get("topk_ids"),
        topk_values=packed.get("topk_values"),
        token_mask=packed["token_mask"],
        segments=segments,
        positions=packed.get("positions"),
    )
