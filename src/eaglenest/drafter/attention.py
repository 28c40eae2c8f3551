"""The drafter's attention in training-time test (TTT), in memory linear in the sample length.

`training_attention` is the one entry point (`eaglenest.drafter.layers.Attention.forward` calls it).
Step i of TTT attends, at position t, to the step-0 keys of positions <= t (causal) and to the
keys of steps 1..i at position t only (each position's own draft chain), as in the EAGLE-3
reference training code. The causal part is `scaled_dot_product_attention` over the step-0 keys,
and each earlier step adds one diagonal score per position; the two are merged by log-sum-exp
(`causal_logsumexp`, with a hand-written backward). No [T, T] block is kept for backward, so
32K-token samples train. Rows that pack several samples (`visible`) see only their own sample's
keys: through one dense masked block while it is small (fastest on the demo), else the same
linear-memory path with the mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Scores of one chunk of queries in the causal log-sum-exp (elements; 64 MiB in float32): the
# chunk's [rows, T] block exists only while its log-sum-exp is computed, in forward and again
# in backward.
LSE_CHUNK_SCORES = 1 << 24
# Packed rows attend through one dense [B, heads, T, T + steps] block a step (kept for backward;
# the fastest path at small sizes) while it has at most this many scores; above, the linear-memory
# path with the mask. 64K tokens in 2048-token rows with 32 heads would keep 17 GB a step dense.
DENSE_PACKED_SCORES = 1 << 24


def training_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    visible: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Step len(keys) - 1 of TTT: queries q [B, heads, T, d] over the keys and values of every
    step so far (expanded to the query heads), [B, heads, T, d_v] out. `visible` [B, 1, T, T]:
    the step-0 keys each query may see, for rows that pack several samples (None: causal)."""
    dense_scores = q.numel() // q.shape[-1] * (keys[0].shape[2] + len(keys) - 1)
    if visible is not None and dense_scores <= DENSE_PACKED_SCORES:
        return _packed(q, keys, values, visible, scale)
    if len(keys) == 1:
        return _prefix_attention(q, keys[0], values[0], visible)
    return _merged(q, keys, values, visible, scale)


def _merged(q, keys: list[torch.Tensor], values: list[torch.Tensor], visible, scale: float):
    """Step >= 1: softmax over [causal step-0 scores, one diagonal score per earlier step],
    as the prefix attention's output and log-sum-exp merged with the diagonal terms.
    `visible` [B, 1, T, T]: the step-0 keys each query may see, when not all earlier ones."""
    prefix = _prefix_attention(q, keys[0], values[0], visible)
    wide = torch.promote_types(q.dtype, torch.float32)  # bf16 scores merged in float32
    # [B, heads, T, 1 + steps]: the prefix's log-sum-exp, then each step's own score.
    lse = causal_logsumexp(q, keys[0], scale, visible)
    own = [(q * key).sum(-1).to(wide) * scale for key in keys[1:]]
    scores = torch.stack([lse, *own], dim=-1)
    weights = scores.softmax(-1).to(q.dtype)
    out = weights[..., :1] * prefix
    for j, value in enumerate(values[1:]):
        out = out + weights[..., 1 + j : 2 + j] * value
    return out


def _packed(q, keys: list[torch.Tensor], values: list[torch.Tensor], visible, scale: float):
    """Rows packing several samples (short ones): the same softmax as `_merged`, over the
    step-0 keys `visible` allows and each earlier step's own score, as one dense block."""
    wide = torch.promote_types(q.dtype, torch.float32)
    prefix = (q @ keys[0].transpose(-1, -2)).to(wide) * scale
    prefix = prefix.masked_fill(~visible, float("-inf"))
    own = [(q * key).sum(-1, keepdim=True).to(wide) * scale for key in keys[1:]]
    weights = torch.cat([prefix, *own], dim=-1).softmax(-1).to(q.dtype)
    t = q.shape[2]
    out = weights[..., :t] @ values[0]
    for j, value in enumerate(values[1:]):
        out = out + weights[..., t + j : t + j + 1] * value
    return out


def _prefix_attention(q, k, v, visible: torch.Tensor | None) -> torch.Tensor:
    """Attention over the step-0 keys: causal, or as `visible` [B, 1, T, T] allows."""
    if visible is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


def _chunk_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    first: int,
    scale: float,
    matmul_dtype: torch.dtype,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal scores of queries first.. (q [B, h, n, d]) against keys k[:first+n], in float32
    (-inf where a key lies after the query, or where `visible` [B, 1, T, T] hides it); the
    matmul runs in `matmul_dtype`."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(matmul_dtype) @ k.to(matmul_dtype).transpose(-1, -2)).to(wide) * scale
    last = first + q.shape[2]
    if visible is not None:
        return scores.masked_fill_(~visible[:, :, first:last, : k.shape[2]], float("-inf"))
    rows = torch.arange(first, last, device=q.device)[:, None]
    seen = torch.arange(k.shape[2], device=q.device)[None, :] <= rows
    return scores.masked_fill_(~seen, float("-inf"))


def _lse_chunks(t: int, b: int, h: int):
    """(first, last) rows of each chunk of queries: LSE_CHUNK_SCORES scores at most a chunk."""
    rows = max(1, LSE_CHUNK_SCORES // (b * h * t))
    return [(first, min(first + rows, t)) for first in range(0, t, rows)]


class _CausalLogSumExp(torch.autograd.Function):
    """The causal log-sum-exp with a hand-written backward: d lse_t / d score_ts is the softmax
    p_ts, so grad_q_t = scale * g_t * sum_s p_ts k_s and grad_k_s = scale * sum_t g_t p_ts q_t.
    Backward recomputes each chunk's scores and adds the chunk's share into one grad_q and one
    grad_k buffer, so it allocates no per-chunk full-size gradient (autograd's backward of a
    `k[:, :, :last]` slice is a zero-padded copy of all of k, one per chunk) and no block whose
    size changes from chunk to chunk beyond the scores themselves."""

    @staticmethod
    def forward(ctx, q, k, scale: float, matmul_dtype: torch.dtype, visible=None):
        b, h, t, _ = q.shape
        wide = torch.promote_types(q.dtype, torch.float32)
        lse = torch.empty(b, h, t, dtype=wide, device=q.device)
        for first, last in _lse_chunks(t, b, h):
            scores = _chunk_scores(
                q[:, :, first:last], k[:, :, :last], first, scale, matmul_dtype, visible
            )
            torch.logsumexp(scores, -1, out=lse[:, :, first:last])
            del scores
        ctx.save_for_backward(q, k, lse, visible)
        ctx.scale, ctx.matmul_dtype = scale, matmul_dtype
        return lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, lse, visible = ctx.saved_tensors
        scale, matmul_dtype = ctx.scale, ctx.matmul_dtype
        b, h, t, _ = q.shape
        wide = lse.dtype
        grad_q = torch.zeros(q.shape, dtype=wide, device=q.device)
        grad_k = torch.zeros(k.shape, dtype=wide, device=k.device)
        grad = grad.to(wide) * scale
        for first, last in _lse_chunks(t, b, h):
            q_chunk, k_seen = q[:, :, first:last], k[:, :, :last]
            weights = _chunk_scores(q_chunk, k_seen, first, scale, matmul_dtype, visible)
            weights.sub_(lse[:, :, first:last, None]).exp_().mul_(grad[:, :, first:last, None])
            weights = weights.to(matmul_dtype)
            grad_q[:, :, first:last] = weights @ k_seen.to(matmul_dtype)
            grad_k[:, :, :last] += weights.transpose(-1, -2) @ q_chunk.to(matmul_dtype)
            del weights
        grad_q = grad_q.to(q.dtype) if ctx.needs_input_grad[0] else None
        grad_k = grad_k.to(k.dtype) if ctx.needs_input_grad[1] else None
        return grad_q, grad_k, None, None, None


def causal_logsumexp(
    q: torch.Tensor, k: torch.Tensor, scale: float, visible: torch.Tensor | None = None
) -> torch.Tensor:
    """log sum_{s<=t} exp(scale * q_t . k_s) [B, h, T] in float32 (over the s that `visible`
    [B, 1, T, T] allows, when given), a chunk of queries at a time (LSE_CHUNK_SCORES scores a
    chunk). Under autograd only q, k and the result are kept; backward
    recomputes each chunk's scores (`_CausalLogSumExp`): memory stays linear in T. Under autocast
    the score matmuls run in the autocast dtype, as autocast would run them."""
    device = q.device.type
    matmul_dtype = (
        torch.get_autocast_dtype(device)
        if torch.is_autocast_enabled(device)
        else torch.promote_types(q.dtype, torch.float32)
    )
    with torch.autocast(device, enabled=False):
        return _CausalLogSumExp.apply(q, k, scale, matmul_dtype, visible)
