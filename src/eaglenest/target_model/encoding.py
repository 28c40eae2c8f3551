"""Batched encode and decode with the target's tokenizer, as `tokenizer(...)` and
`tokenizer.decode` give them (no special tokens added, none skipped, no clean-up), through the
Rust backend where that gives the very same ids: per-piece Python calls would make tokenizing many
times slower than the tokenizer itself."""

from __future__ import annotations

import weakref
from typing import Any


def encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts, add_special_tokens=False)` ids; through the Rust tokenizer's
    `encode_batch_fast` (no offsets, a third faster) when that gives the very same ids."""
    if not texts:
        return []
    if _fast_encoder_ok(tokenizer):
        encodings = tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [encoding.ids for encoding in encodings]
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]


_FAST_ENCODER_PROBE = [
    "Hi <think>\n 2 + 2 = **4**\n\n</think>\n\n x<|im_end|>",
    " \t\u00e9\u4e2d 12 \n",
]


_FAST_ENCODER_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per tokenizer object


def _fast_encoder_ok(tokenizer: Any) -> bool:
    """True when the Rust batch encode is what `tokenizer(...)` runs: a fast tokenizer whose class
    changes nothing on the way, same special-token handling, and same ids on a probe text."""
    if tokenizer in _FAST_ENCODER_OK:
        return _FAST_ENCODER_OK[tokenizer]
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "backend_tokenizer", None)
    ok = (
        isinstance(tokenizer, TokenizersBackend)
        and hasattr(backend, "encode_batch_fast")
        and type(tokenizer)._encode_plus is TokenizersBackend._encode_plus
        and type(tokenizer).__call__ is TokenizersBackend.__call__
        and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))
    )
    if ok:
        expected = tokenizer(_FAST_ENCODER_PROBE, add_special_tokens=False)["input_ids"]
        fast = backend.encode_batch_fast(_FAST_ENCODER_PROBE, add_special_tokens=False)
        ok = [e.ids for e in fast] == expected
    _FAST_ENCODER_OK[tokenizer] = ok
    return ok


def decode_batch(tokenizer: Any, ids: list[list[int]]) -> list[str]:
    if not ids:
        return []
    if getattr(tokenizer, "is_fast", False):
        # The Rust decoder directly: the same text as tokenizer.decode without cleanup, 3x faster.
        return tokenizer.backend_tokenizer.decode_batch(ids, skip_special_tokens=False)
    return tokenizer.batch_decode(
        ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
