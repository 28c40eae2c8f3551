"""DFlash: a block of tokens drafted in one forward (arXiv 2602.06036), readable top to bottom:
the layer ids it is conditioned on, its config, the model, the training objective. Its export
(the checkpoint vLLM 0.32 loads as `DFlashDraftModel`) is eaglenest.drafter.dflash.export;
its training objective eaglenest.drafter.dflash.loss.

The model, as vLLM's DFlashQwen3ForCausalLM computes it (model_executor/models/qwen3_dflash.py):

    context = hidden_norm(fc(aux))      [T, H]   the target's aux states of the verified tokens
    block   = embed([bonus, mask, ..., mask])     block_size tokens at positions a .. a+bs-1
    per layer (Qwen3: q/k RMSNorm per head, rotary, no bias):
        keys/values = k_norm(k_proj(context)), v_proj(context)      (no input_layernorm)
                    + the block's own, from input_layernorm(h)
        h = h + o_proj(attention(q_norm(q_proj(input_layernorm(h)))))   non-causal in the block
        h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h)): slot j >= 1 drafts the token at a + j

vLLM computes the context keys once per verified token (`precompute_and_store_context_kv`,
qwen3_dflash.py:651: hidden_norm, the KV rows of each layer's qkv_proj, k_norm, rotary) and
queries [bonus, mask x K] at positions last+1 .. last+1+K (v1/spec_decode/utils.py:707-737),
sampling the K mask slots: block_size = num_speculative_tokens + 1. The block is non-causal
(`_dflash_layer_causal`, qwen3_dflash.py:86-97; the proposer asserts it,
v1/spec_decode/dflash.py:304-311).

Training (vllm-project/speculators' DFlash, models/dflash/; SpecForge's core/dflash.py): anchors
are positions of the answer whose next token is in it (`select_anchors`); the block at anchor a
takes [x_a, mask x (bs-1)] at positions a .. a+bs-1 and sees the context of positions < a of its
own sample and its own block, nothing else (`block_attention_mask`): no later real token, no
other block. Slot j learns the target's distribution at a + j - 1, i.e. its next token x_a+j,
weighted exp(-(j-1)/gamma) (slot 0, the anchor, untrained; slots past the answer, the sample or
the row untrained), summed and divided by the count of trained slots (speculators'
`dflash_loss_decay`, losses/utils.py; `compute_metrics`, dflash/metrics.py). With `head` target
(the references' layout) the logits are the target's LM head over its whole vocabulary, frozen.

Cost: a row's N anchors make N·bs queries over T + N·bs keys, through SDPA calls of
ANCHOR_CHUNK blocks with a boolean mask [chunk·bs, T + chunk·bs] each (speculators builds the
whole mask block-sparse for flex attention); `max_anchors` bounds N, the chunks the memory.

The token and hidden-state shards are EAGLE-3's (drafter/batches.py): `aux` [T, n·H] at the
captured `aux_layer_ids`, the target signal, input_ids, loss_mask. DFlash reads its own layers
of that one capture (train.aux_layer_ids.dflash, default z-lab's five: settings/families.py),
named its own way (`dflash_target_layer_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eaglenest.drafter.config import ConfigDict, DrafterConfig
from eaglenest.drafter.layers import MLP, YARN_KEYS, RMSNorm, apply_rope, rope_cos_sin
from eaglenest.drafter.vocab_head import VocabHead
from eaglenest.settings.families import DFLASH_HEADS, DRAFTER_VARIANTS

# The recipe's defaults: speculators' (models/dflash/core.py: block_size 8, max_anchors 512,
# dflash_decay_gamma 4.0), also NVIDIA Model-Optimizer's DFlash recipe. Block 8 drafts K = 7
# tokens, the project's default TTT steps for EAGLE-3, so the families compare at one K. The
# gamma that follows other blocks is settings/families.py's `dflash_gamma`.
BLOCK_SIZE = 8
MAX_ANCHORS = 512
GAMMA = 4.0
# Blocks per attention call in `DFlashDrafter.forward` (512 queries at block 8).
ANCHOR_CHUNK = 64


# ---- the layers it is conditioned on ---------------------------------------------------------


def dflash_target_layer_ids(aux_layer_ids: Sequence[int]) -> list[int]:
    """DFlash's `target_layer_ids` for the project's `aux_layer_ids`.

    Ours follow vLLM's EAGLE-3 convention (DESIGN.md): id k is the INPUT of decoder layer k,
    transformers' hidden_states[k]. DFlash's id i is the OUTPUT of decoder layer i,
    hidden_states[i + 1] (z-lab's `extract_context_feature`), and vLLM adds the 1 when it
    captures for a DFlash drafter:
      vllm/v1/worker/gpu_model_runner.py:5274-5277 (V1 runner: `i + 1 for i in
        dflash_config["target_layer_ids"]`, only when the config has no top-level
        eagle_aux_hidden_state_layer_ids, :5268);
      vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:110-111 (V2 runner, the same);
      vllm/transformers_utils/configs/speculators/algos.py:117-121 (speculators' vLLM-style
        aux ids written as `i - 1`, the translation made here).
    Measured in vLLM 0.32 (VLLM-FAMILIES.md): target_layer_ids [1, 3, 4] fed hidden_states
    [2, 4, 5], the project's default aux layers of the 8-layer demo."""
    ids = [int(i) - 1 for i in aux_layer_ids]
    if any(i < 0 for i in ids):
        raise ValueError(
            f"aux layer ids {list(aux_layer_ids)}: id 0 (the embedding output) has no DFlash "
            "target layer id (the output of layer -1)"
        )
    return ids


def aux_layer_ids_from_dflash(target_layer_ids: Sequence[int]) -> tuple[int, ...]:
    """The inverse of `dflash_target_layer_ids`: what vLLM captures for them."""
    return tuple(int(i) + 1 for i in target_layer_ids)


# ---- the config ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DFlashConfig(ConfigDict):
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # the project's convention (`dflash_target_layer_ids`)
    num_hidden_layers: int
    block_size: int  # the anchor token and block_size - 1 drafted ones
    mask_token_id: int  # a token of the target's vocabulary, embedded by the target
    # DFLASH_HEADS: "target" = the target's LM head over its whole vocabulary, frozen and never
    # exported (draft_vocab_size = vocab_size); "draft" = one of its own over the draft vocabulary.
    # An export recorded before the key existed had its own ("draft").
    head: str = "draft"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # The target's rotary schedule past the default (rope_type yarn and its YARN_KEYS: Kimi-K2.5's
    # x64 from 4,096), trained and exported as the target's; None: the default. A drafter rotating
    # otherwise than its target decays where the target's scaling starts (VLLM-FAMILIES.md (d)).
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"DFlash block_size {self.block_size}: at least 2 (1 + K drafted)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DFlash mask_token_id {self.mask_token_id} is not a token of the target's "
                f"vocabulary (0..{self.vocab_size - 1})"
            )
        if self.num_hidden_layers < 1:
            raise ValueError(f"DFlash num_hidden_layers {self.num_hidden_layers}: at least 1")
        if self.head not in DFLASH_HEADS:
            raise ValueError(f"DFlash head {self.head!r}: one of {', '.join(DFLASH_HEADS)}")
        if self.head == "target" and self.draft_vocab_size != self.vocab_size:
            raise ValueError(
                f"DFlash head target predicts the target's {self.vocab_size} ids, not a draft "
                f"vocabulary of {self.draft_vocab_size}"
            )
        dflash_target_layer_ids(self.aux_layer_ids)

    @property
    def target_head(self) -> bool:
        """The LM head is the target's, frozen, and no export holds it."""
        return self.head == "target"

    @classmethod
    def from_drafter(
        cls,
        base: DrafterConfig,
        *,
        num_hidden_layers: int,
        block_size: int,
        mask_token_id: int,
        rope_scaling: dict[str, Any] | None = None,
        head: str = "draft",
    ) -> DFlashConfig:
        """The sizes of an EAGLE-3 drafter config (DrafterConfig.from_target), as DFlash, with
        the target's rotary scaling (`target_rope_scaling`); with the target's head, over the
        target's whole vocabulary."""
        variants = [name for name in DRAFTER_VARIANTS if getattr(base, name)]
        if base.attention != "llama" or base.sliding_window is not None or variants:
            raise ValueError(
                "DFlash is Qwen3 attention over the whole context: train.drafter.attention "
                "llama, no sliding_window, none of the EAGLE-3 variants "
                f"(got {base.attention}, window {base.sliding_window}, variants {variants})"
            )
        names = {f.name for f in fields(cls)} & {f.name for f in fields(DrafterConfig)}
        sizes = {name: getattr(base, name) for name in names}
        if head == "target":
            sizes["draft_vocab_size"] = base.vocab_size
        return cls(
            **sizes,
            num_hidden_layers=num_hidden_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            rope_scaling=rope_scaling,
            head=head,
        )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, head_dim] of positions [B, T], in the target's schedule."""
        return rope_cos_sin(positions, self.head_dim, self.rope_theta, scaling=self.rope_scaling)


def served_positions(target_config: Any) -> int:
    """The positions a target serves (its text config's max_position_embeddings; with YaRN the
    scaled range, as Kimi-K2.5's 262,144), which a DFlash export must cover itself."""
    return getattr(_text_config(target_config), "max_position_embeddings", 0) or 0


def _text_config(target_config: Any) -> Any:
    if hasattr(target_config, "get_text_config"):
        return target_config.get_text_config()
    return target_config


def target_rope_scaling(target_config: Any) -> dict[str, Any] | None:
    """The rotary scaling of a target's (text) config, as DFlash trains and exports it: None for
    the default schedule, the YaRN keys it sets for yarn (transformers 5 `rope_parameters`, or an
    older config's `rope_scaling`); another schedule is refused, naming it."""
    text = _text_config(target_config)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(
            f"train.families dflash: the target's rope_type {rope_type!r} is not one DFlash "
            "trains with (default or yarn, as vLLM's Qwen3 DFlash rotates)"
        )
    return {"rope_type": "yarn", **{k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}}


# ---- the model ----------------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys and values are the context's, then the block's own."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = self.config = config
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.config.head_dim).transpose(1, 2)

    def forward(self, x, context, rope: tuple[torch.Tensor, torch.Tensor], mask) -> torch.Tensor:
        """x [B, Q, H] (normed block states), context [B, C, H]; `rope` (cos, sin) of the
        context's positions then the block's, [B, 1, C + Q, d]; mask [B, 1, Q, C + Q]."""
        c, c_len = self.config, context.shape[1]
        cos, sin = rope
        both = torch.cat([context, x], dim=1)
        q = self.q_norm(self._heads(self.q_proj(x), c.num_attention_heads))
        q = apply_rope(q, cos[:, :, c_len:], sin[:, :, c_len:])
        k = apply_rope(self.k_norm(self._heads(self.k_proj(both), c.num_key_value_heads)), cos, sin)
        v = self._heads(self.v_proj(both), c.num_key_value_heads)
        groups = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, context, rope, mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), context, rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(VocabHead):
    """Tensor names are vLLM's (`dflash_export`); the embedding is the target's, frozen and
    never exported (vLLM shares the target's: mask token included), and so is the LM head with
    `head` target (the references' layout: z-lab's, SpecForge's, speculators')."""

    family = "dflash"  # train.families' name (settings/families.py): the stages' tables' key

    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(not c.target_head)
        self.register_vocab(c)  # d2t/t2d, as EAGLE-3's (eaglenest.drafter.vocab_head)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but what comes from the target head file: the embedding, and the LM head
        when it is the target's."""
        state = super().trainable_state_dict()
        if self.config.target_head:
            state.pop("lm_head.weight")
        return state

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        segments: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, N, block_size, D] of the block at each anchor [B, N] (-1: none, see
        `select_anchors`) of rows aux [B, T, n_aux·H_target], input_ids [B, T]; slot j drafts
        the token at anchor + j. `segments` [B, T]: rows packing several samples
        (`Batch.segments`): rotary positions restart at each sample, context stays in it.
        `positions` [B, T] (`Batch.positions`, a view's): the rows' rotary positions; a block
        sits at its anchor's plus 0 .. bs-1.

        The blocks go through the layers ANCHOR_CHUNK at a time, each chunk recomputed in
        backward when training: a long row's mask and attention scores are then [chunk·bs,
        T + chunk·bs], never [N·bs, ...] nor [T, T], and its activations one chunk's."""
        b, t = input_ids.shape
        if positions is None:
            positions = sample_positions(segments, b, t, input_ids.device)
        context = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))
        several = anchors.shape[1] > ANCHOR_CHUNK and torch.is_grad_enabled()
        chunks = []
        for start in range(0, max(anchors.shape[1], 1), ANCHOR_CHUNK):
            part = anchors[:, start : start + ANCHOR_CHUNK]
            args = (context, input_ids, positions, part, segments)
            if several:
                chunks.append(checkpoint(self.block_logits, *args, use_reentrant=False))
            else:
                chunks.append(self.block_logits(*args))
        return torch.cat(chunks, dim=1)

    def block_logits(
        self,
        context: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        anchors: torch.Tensor,
        segments: torch.Tensor | None,
    ) -> torch.Tensor:
        """`forward` of some anchors, given the normed context [B, T, H] and rotary positions."""
        b, t = input_ids.shape
        n, size = anchors.shape[1], self.config.block_size
        at = anchors.clamp(min=0)
        ids = torch.full((b, n, size), self.config.mask_token_id, device=input_ids.device)
        ids[..., 0] = input_ids.gather(1, at)
        offsets = torch.arange(size, device=input_ids.device)
        block_positions = (positions.gather(1, at)[..., None] + offsets).reshape(b, n * size)
        cos, sin = self.config.rope(torch.cat([positions, block_positions], dim=1))
        h = self.embed_tokens(ids.reshape(b, n * size)).to(context.dtype)
        mask = block_attention_mask(anchors, t, size, segments)
        for layer in self.layers:
            h = layer(h, context, (cos, sin), mask)
        return self.lm_head(self.norm(h)).view(b, n, size, self.config.draft_vocab_size)


def sample_positions(
    segments: torch.Tensor | None, b: int, t: int, device: torch.device
) -> torch.Tensor:
    """Rotary positions [B, T]: the token's index in its sample (rows packing several)."""
    positions = torch.arange(t, device=device).expand(b, t)
    if segments is None:
        return positions
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return positions - torch.where(starts, positions, 0).cummax(-1).values


def block_attention_mask(
    anchors: torch.Tensor, t: int, block_size: int, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, 1, N·bs, T + N·bs] bool: the keys each block query sees. Context key s: s < its
    anchor, in the anchor's sample (none for a missing anchor); block keys: all of its own
    block (non-causal) and no other block's."""
    b, n = anchors.shape
    device = anchors.device
    anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    keys = torch.arange(t, device=device)
    context = (keys[None, None, :] < anchor[..., None]) & (anchor >= 0)[..., None]
    if segments is not None:
        own_sample = segments.gather(1, anchor.clamp(min=0))
        context = context & (segments[:, None, :] == own_sample[..., None])
    block = torch.arange(n * block_size, device=device) // block_size
    same_block = (block[:, None] == block[None, :]).expand(b, -1, -1)
    return torch.cat([context, same_block], dim=-1)[:, None]
