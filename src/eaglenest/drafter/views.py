"""Which tokens of a sample a drafter trains on, and at which rotary positions (`train.sequence`,
settings/train.py `SequenceSettings`).

A view keeps a sample's rows [0, sink) then [start, stop), each at its true position: `head`
keeps the first `length` rows; `windows` keeps a sink (the prompt, or a count of first tokens)
and a window of `length - sink` consecutive rows at a random depth of the answer. A sample no
longer than `length` has no view (it trains whole, positions from 0, as `whole` trains every
sample). The hidden states of the kept rows are the target's over the whole sample, so what the
drafter reads at a window's token is exact; what it attends to is the sink and the window.

The window's depth is a draw per (train.seed, epoch, sample) (`window_draws`), resolved when the
sample's rows are read (its prompt length is known then: `sample_view`), so a resumed run reads
the windows the killed one would have, and every epoch reads new ones.

The seam: a target is trained only where it is the true next position (`continues`): one rule for
a window after its sink and for packed rows, whose positions restart at each sample. And a key
holds no token from across it: EAGLE-3 and P-EAGLE key a row with its hidden state and the NEXT
row's token, so the sink's last row would key the window's first token, a pair no served context
holds, seen by every query of the window. The window's first row therefore holds the token after
the sink instead (`seam_row`): no row of the window reads its own first token (a row reads the
tokens after it), and DFlash, which reads an anchor's own token, anchors no block there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from eaglenest.settings.train import SequenceSettings

# Keeps the window draws' random stream apart from the epoch order's ([seed, epoch]).
DRAW_STREAM = 7


@dataclass(frozen=True)
class SampleView:
    """Rows [0, sink) then [start, stop) of a sample, at their own positions (sink <= start)."""

    sink: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.sink + self.stop - self.start

    def spans(self) -> list[tuple[int, int]]:
        """The kept row ranges, in order, empty ones left out."""
        return [(a, b) for a, b in ((0, self.sink), (self.start, self.stop)) if b > a]

    @property
    def seam_row(self) -> int | None:
        """The row whose token is the one after the sink (`sink`), where a window follows a
        sink with a gap; None where the kept rows are consecutive."""
        return self.sink if 0 < self.sink < self.start else None

    def positions(self) -> torch.Tensor:
        """[length] int64: each kept row's rotary position (its index in the sample)."""
        return torch.cat([torch.arange(a, b) for a, b in self.spans()])


def viewed_length(sequence: SequenceSettings | None, n: int) -> int:
    """The rows a sample of n tokens trains on (what batches are formed by)."""
    if sequence is None or sequence.mode == "whole":
        return n
    return min(n, sequence.length)


def sink_tokens(sequence: SequenceSettings, prompt_len: int) -> int:
    """The sink of a windowed sample: its prompt, capped so that the window keeps at least half
    of `length`, or the configured count."""
    if sequence.sink == "prompt":
        return min(prompt_len, sequence.length // 2)
    return int(sequence.sink)


def sample_view(
    sequence: SequenceSettings | None, n: int, prompt_len: int, draw: int
) -> SampleView | None:
    """The view of a sample of n tokens whose answer starts at `prompt_len`; None where it trains
    whole. The window starts in the answer (after the sink and the prompt) where the sample
    leaves room, at `draw` modulo the starts there are: uniform over them."""
    if sequence is None or sequence.mode == "whole" or n <= sequence.length:
        return None
    if sequence.mode == "head":
        return SampleView(0, 0, sequence.length)
    sink = sink_tokens(sequence, prompt_len)
    window = sequence.length - sink
    last = n - window  # the latest start that keeps a whole window
    first = min(max(sink, prompt_len), last)
    start = first + int(draw) % (last - first + 1)
    return SampleView(sink, start, start + window)


def window_draws(seed: int, epoch: int, count: int) -> np.ndarray:
    """One draw per sample (by its index in the plan) of an epoch: a function of (seed, epoch)
    only, drawn at once (a generator per sample would cost seconds an epoch at 500K samples)."""
    rng = np.random.default_rng([seed, epoch, DRAW_STREAM])
    return rng.integers(0, 2**62, size=count, dtype=np.int64)


def continues(positions: torch.Tensor, offset: int) -> torch.Tensor:
    """[B, T] bool: the row index t + offset holds position positions[t] + offset, i.e. its
    token is the true one `offset` after t's (False where t + offset is past the row)."""
    b, t = positions.shape
    out = torch.zeros((b, t), dtype=torch.bool, device=positions.device)
    if offset < t:
        out[:, : t - offset] = positions[:, offset:] == positions[:, : t - offset] + offset
    return out
