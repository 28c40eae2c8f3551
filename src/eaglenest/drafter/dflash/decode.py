"""DFlash decoding as vLLM 0.32 serves it: the context's keys and values computed once per
verified token and kept, and one forward of the block [bonus, mask x K] over them.

vLLM's DFlashProposer (v1/spec_decode/dflash.py) does not run the drafter over the context: it
writes each verified token's keys and values straight into the drafter's KV cache
(`precompute_and_store_context_kv`, model_executor/models/qwen3_dflash.py: hidden_norm(fc(aux)),
each layer's k/v projection, k_norm, rotary at the token's position), then queries only the
block: the last verified token's bonus token and K mask tokens at positions last+1 ..
last+1+K (v1/spec_decode/utils.py, copy_and_expand_dflash_inputs_kernel), non-causal, and
samples the K mask slots. `DFlashContext` is that cache; `draft_block` that forward. Both reuse
eaglenest.drafter.dflash's modules, so the block equals `DFlashDrafter.forward` at an anchor
(tests/unit/drafter/test_dflash_decode.py holds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from eaglenest.drafter.layers import apply_rope

if TYPE_CHECKING:  # the evaluation imports this beside the model (the import graph stays low)
    from eaglenest.drafter.dflash.model import DFlashAttention, DFlashDrafter


@dataclass
class DFlashContext:
    """Per layer, the keys (normed, rotated) and values [1, kv_heads, C, head_dim] of the C
    verified positions so far."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0


def _rope(model: DFlashDrafter, start: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(start, start + n, device=device)[None]
    return model.config.rope(positions)


def _context_kv(attn: DFlashAttention, context: torch.Tensor, cos, sin):
    heads = attn.config.num_key_value_heads
    k = apply_rope(attn.k_norm(attn._heads(attn.k_proj(context), heads)), cos, sin)
    return k, attn._heads(attn.v_proj(context), heads)


@torch.inference_mode()
def extend_context(model: DFlashDrafter, cache: DFlashContext, aux: torch.Tensor) -> None:
    """Adds the verified positions cache.length .. + n - 1, from their aux states [n, n_aux·H]."""
    device = model.fc.weight.device
    context = model.hidden_norm(model.fc(aux.to(device, model.fc.weight.dtype)))[None]
    cos, sin = _rope(model, cache.length, context.shape[1], device)
    for i, layer in enumerate(model.layers):
        k, v = _context_kv(layer.self_attn, context, cos, sin)
        if i == len(cache.keys):
            cache.keys.append(k)
            cache.values.append(v)
        else:
            cache.keys[i] = torch.cat([cache.keys[i], k], dim=2)
            cache.values[i] = torch.cat([cache.values[i], v], dim=2)
    cache.length += context.shape[1]


def _block_attention(attn: DFlashAttention, x, cos, sin, keys, values, mask) -> torch.Tensor:
    c = attn.config
    q = apply_rope(attn.q_norm(attn._heads(attn.q_proj(x), c.num_attention_heads)), cos, sin)
    k_own, v_own = _context_kv(attn, x, cos, sin)
    groups = c.num_attention_heads // c.num_key_value_heads
    k = torch.cat([keys, k_own], dim=2).repeat_interleave(groups, 1)
    v = torch.cat([values, v_own], dim=2).repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attn.o_proj(out.transpose(1, 2).flatten(2))


@torch.inference_mode()
def draft_blocks(
    model: DFlashDrafter,
    cache: DFlashContext,
    bonus: torch.Tensor,
    anchors: torch.Tensor,
    k: int | None = None,
) -> torch.Tensor:
    """The logits [N, K + 1, D] (over the draft vocabulary) of N blocks in one forward:
    block n is [bonus[n], mask x K] at positions anchors[n] .. anchors[n] + K (K: `k`, at most
    and by default block_size - 1; vLLM queries K mask slots whatever the block), sees the
    context keys before its anchor and its own block (non-causal), no other block. Slot j >= 1
    drafts the token at anchors[n] + j. Several anchors over one cached context is the
    simulation's use (teacher-forced, every position of a sample); one at cache.length is
    decoding's (`draft_block`)."""
    device = model.fc.weight.device
    size, n = model.config.block_size if k is None else k + 1, anchors.shape[0]
    if not 2 <= size <= model.config.block_size:
        raise ValueError(f"DFlash block_size {model.config.block_size} drafts 1..bs-1, not {k}")
    anchors = anchors.to(device)
    ids = torch.full((1, n * size), model.config.mask_token_id, device=device)
    ids[0, ::size] = bonus.to(device)
    h = model.embed_tokens(ids).to(model.fc.weight.dtype)
    positions = (anchors[:, None] + torch.arange(size, device=device)).reshape(1, -1)
    cos, sin = model.config.rope(positions)
    keys = torch.arange(cache.length, device=device)
    context = keys[None, :] < anchors.repeat_interleave(size)[:, None]
    block = torch.arange(n * size, device=device) // size
    mask = torch.cat([context, block[:, None] == block[None, :]], dim=-1)[None, None]
    for layer, keys, values in zip(model.layers, cache.keys, cache.values, strict=True):
        x = layer.input_layernorm(h)
        h = h + _block_attention(layer.self_attn, x, cos, sin, keys, values, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.norm(h))[0].view(n, size, -1)


def draft_block(
    model: DFlashDrafter, cache: DFlashContext, bonus: int, k: int | None = None
) -> torch.Tensor:
    """The block's logits [K + 1, D] at anchor cache.length (the next position), as vLLM
    drafts after each verification."""
    anchor = torch.tensor([cache.length])
    return draft_blocks(model, cache, torch.tensor([bonus]), anchor, k)[0]
