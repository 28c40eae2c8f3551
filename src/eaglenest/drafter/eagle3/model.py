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
eaglenest.drafter.attention's `training_attention`.

Layers: EAGLE-3 has the one above. The model takes N (P-EAGLE's 4): layers 1..N-1
(`LaterLayer`, `layers.{i}`) are pre-norm Llama layers over the previous layer's output h'' [H],
as vLLM's llama_eagle3.py runs them, each with its own keys; the last one's h'' is the output.

Here: the EAGLE-3 decoder layer and the later layers, the drafter, then the TTT helpers. Its config is
eaglenest.drafter.config; RMSNorm, rotary embeddings, the TTT stack and the decoding cache,
attention (Llama, then DeepSeek-V3's MLA) and the MLP are eaglenest.drafter.layers.

Tensor names follow the EAGLE-3 checkpoint layout that SGLang (`LlamaForCausalLMEagle3`) and vLLM
(`Eagle3LlamaForCausalLM`) load: fc, midlayer.{input_layernorm, hidden_norm, self_attn.*, mlp.*,
post_attention_layernorm}, norm, lm_head; see eaglenest.drafter.eagle3.export. The token
embedding is the target's, frozen, and is never written to training checkpoints (it is reloaded
from the target head).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.layers import (
    MLP,
    Attention,
    DecodeCache,
    MLAttention,
    RMSNorm,
    TTTStack,
    rope_cos_sin,
    shift_left,
)
from eaglenest.drafter.vocab_head import VocabHead


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on embeddings
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on hidden states
        self.self_attn = MLAttention(config) if config.attention == "mla" else Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, cache: TTTStack | DecodeCache) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        # norm_before_residual: the attention's residual is the normalised hidden state.
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        return residual_block(self, residual, x, cos, sin, cache)


class LaterLayer(nn.Module):
    """A decoder layer after the first (P-EAGLE's layers 1..N-1): a plain pre-norm Llama layer
    over the previous layer's output [.., H], no embedding, as vLLM's llama_eagle3.py runs its
    layers > 0 (their attention takes H; their hidden_norm, which vLLM builds but never uses, is
    left out here and in the export)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, in_features=config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden, cos, sin, cache: TTTStack | DecodeCache) -> torch.Tensor:
        return residual_block(self, hidden, self.input_layernorm(hidden), cos, sin, cache)


def residual_block(layer, residual, x, cos, sin, cache: TTTStack | DecodeCache) -> torch.Tensor:
    """h' = residual + attention(x);  h'' = h' + mlp(post_attention_layernorm(h'))."""
    if isinstance(cache, DecodeCache):
        hidden = residual + layer.self_attn.decode(x, cos, sin, cache)
    else:
        hidden = residual + layer.self_attn(x, cos, sin, cache)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


class Eagle3Drafter(VocabHead):
    family = "eagle3"  # train.families' name (settings/families.py): the stages' tables' key

    def __init__(self, config: DrafterConfig, num_hidden_layers: int = 1):
        super().__init__()
        self.config = config
        # Training only: recompute each decoder layer in backward instead of keeping its
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
        if num_hidden_layers < 1:
            raise ValueError(f"a drafter has at least one decoder layer, not {num_hidden_layers}")
        if num_hidden_layers > 1 and c.attention == "mla":
            raise ValueError("an MLA drafter has one decoder layer (vLLM's deepseek_eagle3.py)")
        # Layers 1..N-1 under vLLM's names (layers.{i}; the first is midlayer = layers.0).
        self.layers = nn.ModuleDict({str(i): LaterLayer(c) for i in range(1, num_hidden_layers)})
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_vocab(c)  # d2t/t2d (eaglenest.drafter.vocab_head)

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
        cache: TTTStack | DecodeCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over [B, T]: logits over the draft vocab, and the hidden state that
        the next step takes in place of fc(aux)."""
        normed, hidden = self.step_states(input_ids, hidden, positions, cache)
        return self.lm_head(normed), hidden

    def step_states(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: TTTStack | DecodeCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` short of the LM head: its input norm(h'') and the next step's hidden state.
        Every decoder layer runs in turn, each with its own keys (`cache.layer(i)`); the last
        one's output is h''."""
        embeds = self.embed(input_ids).to(hidden.dtype)
        c = self.config
        cos, sin = rope_cos_sin(positions, c.rope_dim, c.rope_theta, c.attention == "mla")
        checkpointed = (
            self.checkpoint_layer and isinstance(cache, TTTStack) and torch.is_grad_enabled()
        )
        run = checkpointed_layer if checkpointed else plain_layer
        hidden = run(self.midlayer, cache, embeds, hidden, cos, sin)
        for index, layer in self.layers.items():
            hidden = run(layer, cache.layer(int(index)), hidden, cos, sin)
        normed = self.norm(hidden)
        return normed, normed if self.config.norm_output else hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input tokens' embeddings: the target's (frozen)."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        ttt_steps: int,
        own_tokens: bool = False,
        segments: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Training-time test over a right-padded batch: logits [B, T, D] of every step.

        Step i at position t takes token input_ids[t + 1 + i] and (for i > 0) step i-1's output
        hidden state at t, at rotary position p_t + i (p_t = t, or `positions` [B, T] where a
        view of the sample set them: `Batch.positions`), and predicts the token after it: the
        target's distribution at position t + 1 + i (the loss drops it where that is not
        p_t + 1 + i: a seam, train.ttt_loss). With `own_tokens`, step i > 0 takes step
        i-1's own argmax instead of the data's token (as when serving, where a draft step
        continues from the drafter's previous draft).

        `segments` [B, T] (rows packing several samples, `Batch.segments`): which sample of its
        row each position belongs to. Attention then stays within a sample and rotary positions
        start at 0 for each; positions whose step-i target lies in the next sample are the
        loss's to drop (train.ttt_loss).
        """
        b, t = input_ids.shape
        rows, visible = row_positions(segments, b, t, input_ids.device)
        positions = rows if positions is None else positions
        hidden = self.project(aux)
        cache = TTTStack(visible)
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

    def teacher_forced_states(
        self, aux: torch.Tensor, input_ids: torch.Tensor, ttt_steps: int
    ) -> Iterator[torch.Tensor]:
        """`forward`'s steps on the data's tokens, yielding each step's LM-head input [B, T, H]
        instead of its logits: the evaluation scores the head only where a draft chain is
        still alive (over a large draft vocabulary the head is most of a step's cost)."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        hidden = self.project(aux)
        cache = TTTStack(None)
        for i in range(ttt_steps):
            normed, hidden = self.step_states(
                shift_left(input_ids, 1 + i), hidden, positions + i, cache
            )
            yield normed


def row_positions(
    segments: torch.Tensor | None, b: int, t: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary positions [B, T] (from 0 in each sample of a packed row) and the step-0 keys
    each query may see ([B, 1, T, T], causal within its sample; None for one sample a row)."""
    positions = torch.arange(t, device=device).expand(b, t)
    if segments is None:
        return positions, None
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    positions = positions - torch.where(starts, positions, 0).cummax(-1).values
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return positions, (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]


def plain_layer(layer: nn.Module, cache: TTTStack | DecodeCache, *inputs) -> torch.Tensor:
    return layer(*inputs, cache)


def checkpointed_layer(layer: nn.Module, cache: TTTStack, *inputs) -> torch.Tensor:
    """The decoder layer recomputed in backward. The recomputation must see the cache as the
    step did, so the layer runs on a copy of the earlier steps' keys and values and its own
    ones are added to the real cache afterwards."""
    steps = len(cache)

    def run(*tensors):
        copy = TTTStack(cache.visible)
        earlier = tensors[len(inputs) :]
        copy.keys, copy.values = list(earlier[:steps]), list(earlier[steps:])
        out = layer(*tensors[: len(inputs)], copy)
        return out, copy.keys[-1], copy.values[-1]

    hidden, key, value = checkpoint(run, *inputs, *cache.keys, *cache.values, use_reentrant=False)
    cache.keys.append(key)
    cache.values.append(value)
    return hidden


def ttt_forward(
    model: Eagle3Drafter | nn.Module,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    ttt_steps: int,
    own_tokens: bool = False,
    segments: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Training-time test (`Eagle3Drafter.forward`) through `model`, which may be a DDP wrapper:
    DDP synchronises gradients only for calls that go through its forward."""
    return model(aux, input_ids, ttt_steps, own_tokens, segments, positions)
