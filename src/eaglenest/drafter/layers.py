"""The drafter's building blocks, used by every family's model (eaglenest.drafter.<family>.model): RMSNorm, rotary embeddings,
what attention keeps across steps (the training-time-test stack of every step's keys and values,
and the decoding cache), attention (Llama's, then DeepSeek-V3's MLA) and the MLP."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglenest.drafter.attention import training_attention, window_mask
from eaglenest.drafter.config import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# The rope_parameters of a YaRN schedule (transformers' `_compute_yarn_parameters`, vLLM's
# YaRNScalingRotaryEmbedding: both read these, with these defaults), beside rope_theta and
# rope_type. Kimi-K2.5's: factor 64 from original_max_position_embeddings 4,096.
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    interleaved: bool = False,
    scaling: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim] for integer positions [B, T]: Llama's half-split layout
    (frequency i at dims i and i + d/2), or DeepSeek's interleaved pairs (at 2i and 2i + 1).
    `scaling`: a target's rope_parameters past the default schedule (rope_type yarn, YARN_KEYS),
    None for the default."""
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.float()[..., None] * inv_freq  # [B, T, head_dim/2]
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)[:, None]
    else:
        angles = torch.cat([angles, angles], dim=-1)[:, None]
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: Mapping[str, Any] | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim/2] of a rotary schedule and the factor its cos and sin
    are scaled by: the default one, or YaRN's as transformers' `_compute_yarn_parameters` and
    vLLM's YaRNScalingRotaryEmbedding compute it (the slow frequencies interpolated by `factor`,
    the fast kept, a linear ramp between the dimensions that turn beta_slow and beta_fast times
    over original_max_position_embeddings; cos and sin scaled by 0.1 ln(factor) + 1, or the
    ratio of the mscale terms, or attention_factor)."""
    exponents = torch.arange(0, head_dim, 2, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type != "yarn":
        raise ValueError(f"rope_type {rope_type!r}: the drafter rotates with default or yarn only")
    factor = scaling["factor"]
    low, high = _yarn_correction_range(head_dim, theta, scaling)
    ramp = ((torch.arange(head_dim // 2, device=device).float() - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: extrapolated (the fast dimensions), 0: interpolated
    inv_freq = inv_freq / factor * (1 - kept) + inv_freq * kept
    return inv_freq, _yarn_attention_factor(scaling)


def _yarn_correction_range(
    head_dim: int, theta: float, scaling: Mapping[str, Any]
) -> tuple[float, float]:
    def dimension(rotations: float) -> float:
        turns = scaling["original_max_position_embeddings"] / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low = dimension(scaling.get("beta_fast") or 32)
    high = dimension(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    return low, (high + 0.001 if low == high else high)


def _yarn_attention_factor(scaling: Mapping[str, Any]) -> float:
    def mscale(factor: float, scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, top, bottom = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if top and bottom:
        return float(mscale(factor, top) / mscale(factor, bottom))
    return mscale(factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): the interleaved layout's rotate_half."""
    return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    rotated = rotate_pairs(x) if interleaved else rotate_half(x)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


class TTTStack:
    """Keys and values of every TTT step so far, [B, kv_heads, T, head_dim] each, and for rows
    that pack several samples the step-0 keys each query may see ([B, 1, T, T]: causal, within
    its own sample). This is the first decoder layer's; a drafter of several layers keeps one
    stack per layer (`layer`), all seeing the same keys."""

    def __init__(self, visible: torch.Tensor | None = None) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.visible = visible
        self.deeper: dict[int, TTTStack] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def layer(self, index: int) -> TTTStack:
        """Decoder layer `index`'s stack (0: this one), made on first use."""
        if index == 0:
            return self
        return self.deeper.setdefault(index, TTTStack(self.visible))


class DecodeCache:
    """Keys and values of a decoding drafter [1, kv_heads, S, head_dim]: the step-0 entries of the
    verified context, then the current draft chain's (dropped with `truncate` after each round)."""

    def __init__(self) -> None:
        self.keys = torch.empty(0)
        self.values = torch.empty(0)
        self.deeper: dict[int, DecodeCache] = {}  # the later decoder layers' (`layer`)

    def __len__(self) -> int:
        return 0 if self.keys.numel() == 0 else self.keys.shape[2]

    def layer(self, index: int) -> DecodeCache:
        """Decoder layer `index`'s cache (0: this one), made on first use."""
        if index == 0:
            return self
        return self.deeper.setdefault(index, DecodeCache())

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if len(self) == 0:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)

    def truncate(self, length: int) -> None:
        self.keys = self.keys[:, :, :length]
        self.values = self.values[:, :, :length]
        for cache in self.deeper.values():
            cache.truncate(length)


class Attention(nn.Module):
    """Llama's attention over an input of `in_features` (an EAGLE-3 first layer's 2H: embedding
    and hidden state side by side; a later layer's H)."""

    def __init__(self, config: DrafterConfig, in_features: int | None = None):
        super().__init__()
        self.config = config
        c = config
        inputs = in_features or 2 * c.hidden_size
        self.q_proj = nn.Linear(inputs, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(inputs, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(inputs, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(c.head_dim)  # SDPA's default for the query's head size

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.config.head_dim).transpose(1, 2)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        c = self.config
        q = apply_rope(self._heads(self.q_proj(x), c.num_attention_heads), cos, sin)
        k = apply_rope(self._heads(self.k_proj(x), c.num_key_value_heads), cos, sin)
        v = self._heads(self.v_proj(x), c.num_key_value_heads)
        return q, k, v

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention: each key/value head serves heads // kv_heads query heads."""
        return kv.repeat_interleave(
            self.config.num_attention_heads // self.config.num_key_value_heads, 1
        )

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: TTTStack
    ) -> torch.Tensor:
        """Training-time test: this step's keys join the cache of earlier steps (see module doc)."""
        q, k, v = self._project(x, cos, sin)
        cache.keys.append(k)
        cache.values.append(v)
        keys = [self._expand(key) for key in cache.keys]
        values = [self._expand(value) for value in cache.values]
        window = self.config.sliding_window
        return self._out(training_attention(q, keys, values, cache.visible, self.scale, window))

    def decode(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: DecodeCache
    ) -> torch.Tensor:
        """Decoding: the new rows see every cached key and the new keys up to their own row (or
        the last sliding_window of them: cache index is position)."""
        q, k, v = self._project(x, cos, sin)
        cache.append(k, v)
        index = torch.arange(cache.keys.shape[2], device=x.device)
        mask = window_mask(index[-x.shape[1] :], index, self.config.sliding_window)
        out = F.scaled_dot_product_attention(
            q, self._expand(cache.keys), self._expand(cache.values), attn_mask=mask
        )
        return self._out(out)


class MLAttention(Attention):
    """DeepSeek-V3's multi-head latent attention with the input of an EAGLE-3 layer (2H), in its
    plain form: the latent is expanded to per-head keys and values, so every attention path of
    `Attention` (TTT, packed rows, decoding) runs on them unchanged; vLLM computes the same with
    the latent absorbed. Names as DeepSeek's checkpoints and vLLM's deepseek_eagle3.py."""

    def __init__(self, config: DrafterConfig):
        nn.Module.__init__(self)
        self.config = c = config
        heads, rope, nope = c.num_attention_heads, c.qk_rope_head_dim, c.qk_nope_head_dim
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(2 * c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, heads * (nope + rope), bias=False)
        else:
            self.q_proj = nn.Linear(2 * c.hidden_size, heads * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * c.hidden_size, c.kv_lora_rank + rope, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, heads * (nope + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * c.v_head_dim, c.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(nope + rope)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        c = self.config
        b, t, _ = x.shape
        heads, nope = c.num_attention_heads, c.qk_nope_head_dim
        if c.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(b, t, heads, -1).transpose(1, 2)
        q_pe = apply_rope(q[..., nope:], cos, sin, interleaved=True)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, heads, -1).transpose(1, 2)
        k_nope, v = kv.split([nope, c.v_head_dim], dim=-1)
        k_pe = apply_rope(k_pe[:, None], cos, sin, interleaved=True).expand(-1, heads, -1, -1)
        q = torch.cat([q[..., :nope], q_pe], dim=-1)
        return q, torch.cat([k_nope, k_pe], dim=-1), v


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def shift_left(x: torch.Tensor, by: int, fill: float = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t + by] along dim 1, the vacated tail filled."""
    if by == 0:
        return x
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out
