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

A sliding window W (`train.drafter.sliding_window`) counts rotary positions, as vLLM's attention
backends do when they decode the drafter: a query at position p sees the keys at p - W < s <= p,
W keys with its own (CPU_ATTN and FlashAttention's (W - 1, 0) alike). Step i's query at position t
sits at rotary position t + i, and the key of step j at t at t + j, so it sees the step-0 keys of
the last W - i positions up to t and the keys of steps j > i - W: in decoding, the draft chain's
own keys are the newest W - 1 positions before the query and fill the window first. The windowed
causal part runs a chunk of queries at a time over only the keys their window reaches, so a window
lowers compute and never raises memory.
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
    window: int | None = None,
) -> torch.Tensor:
    """Step len(keys) - 1 of TTT: queries q [B, heads, T, d] over the keys and values of every
    step so far (expanded to the query heads), [B, heads, T, d_v] out. `visible` [B, 1, T, T]:
    the step-0 keys each query may see, for rows that pack several samples (None: causal).
    `window`: the drafter's sliding window in rotary positions (module doc; None: none)."""
    step, t = len(keys) - 1, q.shape[2]
    # The step-0 keys a query sees: the last `span` positions up to its own (None: all).
    span = None if window is None or window - step >= t else window - step
    # The earlier steps' own keys it sees: those of steps j > step - window.
    first = 1 if window is None else max(1, step - window + 1)
    keys, values = [keys[0], *keys[first:]], [values[0], *values[first:]]
    dense_scores = q.numel() // q.shape[-1] * (keys[0].shape[2] + len(keys) - 1)
    if visible is not None and dense_scores <= DENSE_PACKED_SCORES:
        return _packed(q, keys, values, _within(visible, span), scale)
    if len(keys) == 1:
        return _prefix_attention(q, keys[0], values[0], visible, span, scale)
    return _merged(q, keys, values, visible, scale, span)


def _merged(q, keys: list[torch.Tensor], values: list[torch.Tensor], visible, scale: float, span):
    """Step >= 1: softmax over [causal step-0 scores, one diagonal score per earlier step],
    as the prefix attention's output and log-sum-exp merged with the diagonal terms.
    `visible` [B, 1, T, T]: the step-0 keys each query may see, when not all earlier ones;
    `span`: how many positions up to the query's own its window leaves (<= 0: none)."""
    wide = torch.promote_types(q.dtype, torch.float32)  # bf16 scores merged in float32
    own = [(q * key).sum(-1).to(wide) * scale for key in keys[1:]]
    if span is not None and span <= 0:  # the window holds only the draft chain's own keys
        weights = torch.stack(own, dim=-1).softmax(-1).to(q.dtype)
        return sum(weights[..., j : j + 1] * value for j, value in enumerate(values[1:]))
    prefix = _prefix_attention(q, keys[0], values[0], visible, span, scale)
    # [B, heads, T, 1 + steps]: the prefix's log-sum-exp, then each step's own score.
    lse = causal_logsumexp(q, keys[0], scale, visible, span)
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


def window_mask(rows: torch.Tensor, keys: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[len(rows), len(keys)]: whether a query at position `rows[r]` sees the key at `keys[s]`:
    causally, within the last `window` positions (its own included) when given."""
    seen = keys[None, :] <= rows[:, None]
    if window is not None:
        seen &= keys[None, :] > rows[:, None] - window
    return seen


def _within(visible: torch.Tensor, span: int | None) -> torch.Tensor:
    """`visible` [B, 1, T, T] less the keys outside the last `span` positions."""
    if span is None:
        return visible
    index = torch.arange(visible.shape[-1], device=visible.device)
    return visible & window_mask(index, index, span)


def _prefix_attention(
    q, k, v, visible: torch.Tensor | None, span: int | None, scale: float
) -> torch.Tensor:
    """Attention over the step-0 keys: causal, or as `visible` [B, 1, T, T] allows, within the
    last `span` positions (>= 1) when given."""
    if visible is not None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=_within(visible, span), scale=scale
        )
    if span is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    device = q.device.type
    if torch.is_autocast_enabled(device):  # as autocast runs SDPA: in its dtype
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.autocast(device, enabled=False):
        return _WindowedAttention.apply(q, k, v, span, scale)


class _WindowedAttention(torch.autograd.Function):
    """Causal attention within the last `span` positions, a chunk of queries at a time over only
    the keys their window reaches (`_window_chunks`), each through the fused SDPA kernel with the
    band as its mask. Backward recomputes each chunk under autograd on chunk-sized leaves and adds
    their gradients into one grad_q, grad_k and grad_v buffer: only q, k and v are kept for it,
    and no chunk makes a full-size gradient (autograd's backward of a slice would)."""

    @staticmethod
    def forward(ctx, q, k, v, span: int, scale: float):
        b, h, t, _ = q.shape
        out = q.new_empty(b, h, t, v.shape[-1])
        for first, last, lo in _window_chunks(t, 1, span):
            mask = _band(first, last, lo, span, q.device)
            out[:, :, first:last] = F.scaled_dot_product_attention(
                q[:, :, first:last],
                k[:, :, lo:last],
                v[:, :, lo:last],
                attn_mask=mask,
                scale=scale,
            )
        ctx.save_for_backward(q, k, v)
        ctx.span, ctx.scale = span, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v = ctx.saved_tensors
        t = q.shape[2]
        wide = torch.promote_types(q.dtype, torch.float32)
        grads = [torch.zeros(x.shape, dtype=wide, device=x.device) for x in (q, k, v)]
        for first, last, lo in _window_chunks(t, 1, ctx.span):
            chunk = [q[:, :, first:last], k[:, :, lo:last], v[:, :, lo:last]]
            chunk = [x.detach().requires_grad_() for x in chunk]
            with torch.enable_grad():
                out = F.scaled_dot_product_attention(
                    *chunk, attn_mask=_band(first, last, lo, ctx.span, q.device), scale=ctx.scale
                )
            grad_q, grad_k, grad_v = torch.autograd.grad(out, chunk, grad[:, :, first:last])
            grads[0][:, :, first:last] = grad_q
            grads[1][:, :, lo:last] += grad_k
            grads[2][:, :, lo:last] += grad_v
        return *(g.to(x.dtype) for g, x in zip(grads, (q, k, v), strict=True)), None, None


def _band(first: int, last: int, lo: int, span: int | None, device) -> torch.Tensor:
    """[last - first, last - lo]: which of the keys lo.. the queries first.. see."""
    index = torch.arange(last, device=device)
    return window_mask(index[first:], index[lo:], span)


def _chunk_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    first: int,
    lo: int,
    scale: float,
    matmul_dtype: torch.dtype,
    visible: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal scores of queries first.. (q [B, h, n, d]) against the keys lo.. (k [B, h, m, d],
    up to the chunk's last query), in float32: -inf where a key lies after the query, outside
    its `window`, or where `visible` [B, 1, T, T] hides it. The matmul runs in `matmul_dtype`."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(matmul_dtype) @ k.to(matmul_dtype).transpose(-1, -2)).to(wide) * scale
    last = first + q.shape[2]
    seen = _band(first, last, lo, window, q.device)
    if visible is not None:
        seen = seen & visible[:, :, first:last, lo:last]
    return scores.masked_fill_(~seen, float("-inf"))


def _window_chunks(t: int, copies: int, window: int | None) -> list[tuple[int, int, int]]:
    """(first, last, lo) of each chunk of queries first..last-1, whose keys are lo..last-1:
    all earlier ones (no window), else the ones their window reaches. A chunk's [queries, keys]
    block, `copies` times (batch x heads for scores, 1 for a mask), has at most LSE_CHUNK_SCORES
    elements; a windowed chunk holds up to a quarter of `window` queries (at least 128: fewer
    calls), so it computes about 1.25 times the scores its window needs."""
    if window is None:
        rows = max(1, LSE_CHUNK_SCORES // (copies * t))
        return [(first, min(first + rows, t), 0) for first in range(0, t, rows)]
    rows = min(t, max(window // 4, 128))
    rows = max(1, min(rows, LSE_CHUNK_SCORES // (copies * (rows + window))))
    return [
        (first, min(first + rows, t), max(0, first - window + 1)) for first in range(0, t, rows)
    ]


class _CausalLogSumExp(torch.autograd.Function):
    """The causal log-sum-exp with a hand-written backward: d lse_t / d score_ts is the softmax
    p_ts, so grad_q_t = scale * g_t * sum_s p_ts k_s and grad_k_s = scale * sum_t g_t p_ts q_t.
    Backward recomputes each chunk's scores and adds the chunk's share into one grad_q and one
    grad_k buffer, so it allocates no per-chunk full-size gradient (autograd's backward of a
    `k[:, :, :last]` slice is a zero-padded copy of all of k, one per chunk) and no block whose
    size changes from chunk to chunk beyond the scores themselves."""

    @staticmethod
    def forward(ctx, q, k, scale: float, matmul_dtype: torch.dtype, visible=None, window=None):
        b, h, t, _ = q.shape
        wide = torch.promote_types(q.dtype, torch.float32)
        lse = torch.empty(b, h, t, dtype=wide, device=q.device)
        for first, last, lo in _window_chunks(t, b * h, window):
            scores = _chunk_scores(
                q[:, :, first:last],
                k[:, :, lo:last],
                first,
                lo,
                scale,
                matmul_dtype,
                visible,
                window,
            )
            torch.logsumexp(scores, -1, out=lse[:, :, first:last])
            del scores
        ctx.save_for_backward(q, k, lse, visible)
        ctx.scale, ctx.matmul_dtype, ctx.window = scale, matmul_dtype, window
        return lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, lse, visible = ctx.saved_tensors
        scale, matmul_dtype, window = ctx.scale, ctx.matmul_dtype, ctx.window
        b, h, t, _ = q.shape
        wide = lse.dtype
        grad_q = torch.zeros(q.shape, dtype=wide, device=q.device)
        grad_k = torch.zeros(k.shape, dtype=wide, device=k.device)
        grad = grad.to(wide) * scale
        for first, last, lo in _window_chunks(t, b * h, window):
            q_chunk, k_seen = q[:, :, first:last], k[:, :, lo:last]
            weights = _chunk_scores(
                q_chunk, k_seen, first, lo, scale, matmul_dtype, visible, window
            )
            weights.sub_(lse[:, :, first:last, None]).exp_().mul_(grad[:, :, first:last, None])
            weights = weights.to(matmul_dtype)
            grad_q[:, :, first:last] = weights @ k_seen.to(matmul_dtype)
            grad_k[:, :, lo:last] += weights.transpose(-1, -2) @ q_chunk.to(matmul_dtype)
            del weights
        grad_q = grad_q.to(q.dtype) if ctx.needs_input_grad[0] else None
        grad_k = grad_k.to(k.dtype) if ctx.needs_input_grad[1] else None
        return grad_q, grad_k, None, None, None, None


def causal_logsumexp(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """log sum_{s<=t} exp(scale * q_t . k_s) [B, h, T] in float32 (over the s that `visible`
    [B, 1, T, T] allows, when given, and over t - window < s only, when given), a chunk of
    queries at a time (LSE_CHUNK_SCORES scores a chunk). Under autograd only q, k and the result
    are kept; backward recomputes each chunk's scores (`_CausalLogSumExp`): memory stays linear
    in T. Under autocast the score matmuls run in the autocast dtype, as autocast would run
    them."""
    device = q.device.type
    matmul_dtype = (
        torch.get_autocast_dtype(device)
        if torch.is_autocast_enabled(device)
        else torch.promote_types(q.dtype, torch.float32)
    )
    with torch.autocast(device, enabled=False):
        return _CausalLogSumExp.apply(q, k, scale, matmul_dtype, visible, window)
