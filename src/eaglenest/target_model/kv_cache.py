"""A KV cache for long decoding with transformers: DynamicCache whose layers append into buffers
that double when full (GrowingLayer), so a step costs what it adds, not the whole cache again.
The embedded server (demo/batcher.py) and the evaluate stage's live decoding use it."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def growing_cache(model: torch.nn.Module) -> DynamicCache:
    """A DynamicCache for `model` whose full-attention layers are GrowingLayers (sliding-window
    and other layer types are kept as transformers makes them). A model without a config gets
    its layers as it uses them."""
    if getattr(model, "config", None) is None:
        cache = DynamicCache()
        cache.layer_class_to_replicate = GrowingLayer
        return cache
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer() if type(lay) is DynamicLayer else lay for lay in cache.layers]
    return cache


class GrowingLayer(DynamicLayer):
    """transformers' DynamicLayer appending into buffers that double when full. DynamicLayer
    copies its whole cache at every step (torch.cat), quadratic in the answer's length: a
    9,000-token answer took a quarter of an hour here. This is amortised linear, and the
    attention reads the same keys and values (views of the buffers)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers: list[torch.Tensor] = []
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, added = self.length, key_states.shape[-2]
        if not self.buffers or n + added > self.buffers[0].shape[-2]:
            capacity = max(2 * (n + added), 64)
            grown = []
            for old, new in ((self.keys, key_states), (self.values, value_states)):
                buffer = new.new_empty((*new.shape[:-2], capacity, new.shape[-1]))
                if n:
                    buffer[..., :n, :] = old
                grown.append(buffer)
            self.buffers = grown
        for buffer, new in zip(self.buffers, (key_states, value_states), strict=True):
            buffer[..., n : n + added, :] = new
        self.length = n + added
        self.keys, self.values = (b[..., : self.length, :] for b in self.buffers)
        return self.keys, self.values

    def add_rows(self, other: GrowingLayer) -> None:
        """Another cache's rows, left-padded to this one's length (the padding is masked)."""
        pad = self.length - other.length
        grown = []
        for mine, theirs in zip(self.buffers, (other.keys, other.values), strict=True):
            rows = mine.new_zeros((theirs.shape[0], *mine.shape[1:]))
            rows[..., pad : self.length, :] = theirs
            grown.append(torch.cat([mine, rows]))
        self.buffers = grown
        self.keys, self.values = (b[..., : self.length, :] for b in self.buffers)

    def crop(self, max_length: int) -> None:
        """Keep the first max_length positions (negative: drop that many), as DynamicLayer."""
        if max_length < 0:
            max_length = self.length + max_length
        if self.is_initialized and self.buffers and max_length < self.length:
            self.length = max_length
            self.keys, self.values = (b[..., : self.length, :] for b in self.buffers)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized and self.buffers:
            self.buffers = [b[indices, ...] for b in self.buffers]
            self.keys, self.values = (b[..., : self.length, :] for b in self.buffers)
