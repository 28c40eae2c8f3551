"""The EAGLE-3 drafter, readable top to bottom (arXiv 2503.01840).

One Llama-style decoder layer that drafts the target's next tokens from the target's own features:

    aux [T, 3·H_target] (inputs of three target layers) --fc--> h [T, H]
    x = concat(input_layernorm(embed(next token)), hidden_norm(h))   [T, 2H]
    h' = h + attention(x) ;  h'' = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(h''))   over the draft vocabulary

`h''` (before the final norm) is what the next draft step gets instead of `fc(aux)`: that is how
vLLM and SGLang chain draft steps, and how training-time test (TTT) unrolls them here.

Variants vLLM loads (`DrafterConfig`, exported in config.json): `norm_before_fc` (an RMSNorm over
aux before fc), `fc_norm` (one RMSNorm per aux state), `norm_before_residual` (h' starts from
hidden_norm(h), not h) and `norm_output` (the next step gets norm(h''), not h'').

Training-time test: step i feeds step i-1's output hidden states back at every position at once,
with the tokens shifted by one more. A query at position t sees the step-0 keys of positions
<= t (causal) and the keys of steps 1..i at position t only (each position's own draft chain);
rows that pack several samples (`segments`) see only their own sample's keys; a `sliding_window`
keeps the keys of the last W rotary positions. That attention, in memory linear in T, is
eaglenest.drafter_attention's `training_attention`.

Order: the config, RMSNorm, rotary embeddings, the caches, attention (Llama, then DeepSeek-V3's
MLA), the MLP and the EAGLE-3 decoder layer, the drafter, then the TTT helpers.

Tensor names follow the EAGLE-3 checkpoint layout that SGLang (`LlamaForCausalLMEagle3`) and vLLM
(`Eagle3LlamaForCausalLM`) load: fc, midlayer.{input_layernorm, hidden_norm, self_attn.*, mlp.*,
post_attention_layernorm}, norm, lm_head; see eaglenest.formats.drafter_export. The token
embedding is the target's, frozen, and is never written to training checkpoints (it is reloaded
from the target head).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eaglenest.drafter_attention import training_attention, window_mask


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # The EAGLE-3 variants vLLM loads (model_executor/models/llama_eagle3.py), all off in the
    # original EAGLE-3 layout: an RMSNorm over fc's whole input (`input_norm`), one RMSNorm per
    # aux state before fc (`fc_norm.{i}`), the residual taken after hidden_norm instead of
    # before it, and the final norm's output (not its input) fed to the next draft step.
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    # The drafter's attention: `llama` (vLLM's Eagle3LlamaForCausalLM) or `mla`, DeepSeek-V3's
    # multi-head latent attention (vLLM's Eagle3DeepseekV3ForCausalLM): queries through a
    # low-rank `q_lora_rank` (None: one projection), keys and values from one latent of
    # `kv_lora_rank` per token, the rotary part (`qk_rope_head_dim`, interleaved pairs as
    # DeepSeek rotates them) shared by all heads. An MLA target on vLLM's CPU build can only be
    # served beside an MLA drafter (both need its block size of 16).
    attention: str = "llama"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # A sliding window of the decoder layer's attention, in positions (None: full attention);
    # eaglenest.drafter_attention's module doc says what a TTT step sees through it.
    sliding_window: int | None = None

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["aux_layer_ids"] = list(self.aux_layer_ids)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DrafterConfig:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in values.items() if k in names}
        values["aux_layer_ids"] = tuple(values["aux_layer_ids"])
        return cls(**values)

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        draft_vocab_size: int,
        aux_layer_ids: tuple[int, ...],
        overrides: dict[str, Any] | None = None,
    ) -> DrafterConfig:
        """Sizes from the target's (text) config, as EAGLE-3 drafters use, unless overridden."""
        c = (
            target_config.get_text_config()
            if hasattr(target_config, "get_text_config")
            else target_config
        )
        overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        heads = overrides.get("num_attention_heads", c.num_attention_heads)
        hidden = overrides.get("hidden_size", c.hidden_size)
        rope = getattr(c, "rope_parameters", None) or {}
        values = {
            "hidden_size": hidden,
            "target_hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(c, "num_key_value_heads", None) or heads,
            "head_dim": getattr(c, "head_dim", None) or hidden // heads,
            "vocab_size": c.vocab_size,
            "draft_vocab_size": draft_vocab_size,
            "aux_layer_ids": tuple(aux_layer_ids),
            "rms_norm_eps": getattr(c, "rms_norm_eps", 1e-6),
            "rope_theta": rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
            "max_position_embeddings": getattr(c, "max_position_embeddings", 4096),
        }
        if overrides.get("attention") == "mla":
            values.update(_mla_sizes(c, heads))
        values.update(overrides)
        if values["hidden_size"] != c.hidden_size:
            raise ValueError(
                f"drafter hidden_size {values['hidden_size']} differs from the target's "
                f"{c.hidden_size}: the drafter shares the target's token embedding"
            )
        return cls(**{**values, "aux_layer_ids": tuple(values["aux_layer_ids"])})


MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _mla_sizes(target: Any, heads: int) -> dict[str, Any]:
    """An MLA drafter's sizes from an MLA target (DeepSeek-V3, Kimi-K2); its head_dim is the
    query/key head size."""
    if not getattr(target, "kv_lora_rank", None):
        raise ValueError(
            "train.drafter.attention mla: the target's config has no MLA sizes (kv_lora_rank, "
            "qk_rope_head_dim, ...); set them under train.drafter or use attention llama"
        )
    sizes = {name: getattr(target, name, None) for name in MLA_SIZES}
    sizes["head_dim"] = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    sizes["num_key_value_heads"] = heads
    return sizes


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


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim] for integer positions [B, T]: Llama's half-split layout
    (frequency i at dims i and i + d/2), or DeepSeek's interleaved pairs (at 2i and 2i + 1)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    )
    angles = positions.float()[..., None] * inv_freq  # [B, T, head_dim/2]
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)[:, None]
    else:
        angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


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


class KVCache:
    """Keys and values of every TTT step so far, [B, kv_heads, T, head_dim] each, and for rows
    that pack several samples the step-0 keys each query may see ([B, 1, T, T]: causal, within
    its own sample)."""

    def __init__(self, visible: torch.Tensor | None = None) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.visible = visible

    def __len__(self) -> int:
        return len(self.keys)


class DecodeCache:
    """Keys and values of a decoding drafter [1, kv_heads, S, head_dim]: the step-0 entries of the
    verified context, then the current draft chain's (dropped with `truncate` after each round)."""

    def __init__(self) -> None:
        self.keys = torch.empty(0)
        self.values = torch.empty(0)

    def __len__(self) -> int:
        return 0 if self.keys.numel() == 0 else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if len(self) == 0:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)

    def truncate(self, length: int) -> None:
        self.keys = self.keys[:, :, :length]
        self.values = self.values[:, :, :length]


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        c = config
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
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
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache
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


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on embeddings
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on hidden states
        self.self_attn = MLAttention(config) if config.attention == "mla" else Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, cache: KVCache | DecodeCache) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        # norm_before_residual: the attention's residual is the normalised hidden state.
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        if isinstance(cache, DecodeCache):
            hidden = residual + self.self_attn.decode(x, cos, sin, cache)
        else:
            hidden = residual + self.self_attn(x, cos, sin, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        # Training only: recompute the decoder layer in backward instead of keeping its
        # activations (train.activation_checkpointing), for long samples.
        self.checkpoint_layer = False
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        fc_input = len(c.aux_layer_ids) * c.target_hidden_size
        self.input_norm = RMSNorm(fc_input, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in c.aux_layer_ids)
            if c.fc_norm
            else None
        )
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = DecoderLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # The draft vocabulary (see eaglenest.stages.vocab): draft id i is target id i + d2t[i].
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's three aux states [.., 3·H_target] → the drafter's hidden size."""
        aux = aux.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | DecodeCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over [B, T]: logits over the draft vocab, and the hidden state that
        the next step takes in place of fc(aux)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        c = self.config
        cos, sin = rope_cos_sin(positions, c.rope_dim, c.rope_theta, c.attention == "mla")
        if self.checkpoint_layer and isinstance(cache, KVCache) and torch.is_grad_enabled():
            hidden = self._checkpointed_layer(embeds, hidden, cos, sin, cache)
        else:
            hidden = self.midlayer(embeds, hidden, cos, sin, cache)
        normed = self.norm(hidden)
        return self.lm_head(normed), normed if self.config.norm_output else hidden

    def _checkpointed_layer(self, embeds, hidden, cos, sin, cache: KVCache) -> torch.Tensor:
        """The decoder layer recomputed in backward. The recomputation must see the cache as the
        step did, so the layer runs on a copy of the earlier steps' keys and values and its own
        ones are added to the real cache afterwards."""
        steps = len(cache)

        def layer(embeds, hidden, cos, sin, *earlier):
            copy = KVCache(cache.visible)
            copy.keys, copy.values = list(earlier[:steps]), list(earlier[steps:])
            out = self.midlayer(embeds, hidden, cos, sin, copy)
            return out, copy.keys[-1], copy.values[-1]

        hidden, key, value = checkpoint(
            layer, embeds, hidden, cos, sin, *cache.keys, *cache.values, use_reentrant=False
        )
        cache.keys.append(key)
        cache.values.append(value)
        return hidden

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        ttt_steps: int,
        own_tokens: bool = False,
        segments: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Training-time test over a right-padded batch: logits [B, T, D] of every step.

        Step i at position t takes token input_ids[t + 1 + i] and (for i > 0) step i-1's output
        hidden state at t, at rotary position t + i, and predicts the token after it: the
        target's distribution at position t + 1 + i. With `own_tokens`, step i > 0 takes step
        i-1's own argmax instead of the data's token (as when serving, where a draft step
        continues from the drafter's previous draft).

        `segments` [B, T] (rows packing several samples, `Batch.segments`): which sample of its
        row each position belongs to. Attention then stays within a sample and rotary positions
        start at 0 for each; positions whose step-i target lies in the next sample are the
        loss's to drop (train.ttt_loss).
        """
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        visible = None
        if segments is not None:
            starts = torch.ones_like(segments, dtype=torch.bool)
            starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
            positions = positions - torch.where(starts, positions, 0).cummax(-1).values
            causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
            visible = (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]
        hidden = self.project(aux)
        cache = KVCache(visible)
        logits = []
        tokens = shift_left(input_ids, 1)
        for i in range(ttt_steps):
            step_logits, hidden = self.step(tokens, hidden, positions + i, cache)
            logits.append(step_logits)
            if own_tokens:
                tokens = self.draft_to_target(step_logits.detach().argmax(-1))
            else:
                tokens = shift_left(input_ids, 2 + i)
        return logits

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embedding (reloaded from the target head)."""
        return {k: v for k, v in self.state_dict().items() if k != "embed_tokens.weight"}


def shift_left(x: torch.Tensor, by: int, fill: float = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t + by] along dim 1, the vacated tail filled."""
    if by == 0:
        return x
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out


def ttt_forward(
    model: Eagle3Drafter | nn.Module,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    ttt_steps: int,
    own_tokens: bool = False,
    segments: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Training-time test (`Eagle3Drafter.forward`) through `model`, which may be a DDP wrapper:
    DDP synchronises gradients only for calls that go through its forward."""
    return model(aux, input_ids, ttt_steps, own_tokens, segments)
