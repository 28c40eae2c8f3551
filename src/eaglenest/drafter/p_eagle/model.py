"""P-EAGLE: EAGLE-3 drafting its K tokens in one forward (arXiv 2602.01469), readable top to
bottom: the model, its training objective, its export.

The model is eaglenest.drafter.eagle3.model's EAGLE-3 drafter with one more weight, `mask_hidden`
[n_aux·H_target], a mask token id, N decoder layers and, optionally, a trained mask embedding
(speculators' P-EAGLE and the paper: 4 layers, the embedding trained). vLLM 0.32 serves it as `method: eagle3` with
`parallel_drafting: true` (read from the speculative config, config/speculative.py:478, not from
config.json). After each verification it runs ONE forward of the drafter over (read from
v1/spec_decode/utils.py:429-541, copy_and_expand_eagle_inputs_kernel):

    positions  ... p-1      p          p+1      ...  p+K-1
    token      ... x_p      bonus      mask          mask       (tokens shifted by one, as EAGLE-3)
    hidden     ... aux_p-1  aux_p      mask_hidden   mask_hidden

through the drafter's ordinary causal attention, and drafts the argmax at p, p+1, ..., p+K-1.
`mask_hidden` goes through fc (and the input/fc norms) like any aux state
(v1/spec_decode/llm_base_proposer.py:1402-1414); the mask token through the shared embedding
(`mask_token_id`, else `pard_token`, ...: llm_base_proposer.py:356-379).

Layers (vLLM's llama_eagle3.py LlamaModel.forward): layer 0 is EAGLE-3's (attention over
cat(input_layernorm(embed), hidden_norm(h)), 2H); layers 1..N-1 are pre-norm Llama layers over
the previous layer's output (H), no embedding; vLLM carries (mlp output, residual) pairs through
fused add-norms, which is h'' = h' + mlp(norm(h')), h' = h + attention(norm(h)) layer after
layer; the last layer's h'' goes to the final norm and the LM head. Each layer keeps its own keys
(`TTTStack.layer`, `DecodeCache.layer`).

The mask embedding (`train_mask_embedding`): a delta [H] added to the target's embedding row of
the mask token, wherever the mask token is (zero at the start: the target's row). vLLM 0.32 has
one way to embed a token otherwise than the target does: the drafter's own `embed_tokens.weight`
in the checkpoint. Its loader then marks the drafter as having its own embedding
(model_executor/models/utils.py process_eagle_weight) and the proposer keeps it instead of
sharing the target's, as it is not equal to it (v1/spec_decode/llm_base_proposer.py
`_maybe_share_embeddings`). So the export writes the whole table: the target's rows with the
trained mask row (eaglenest.drafter.p_eagle.export); vLLM has no key for one row alone (DFlash's
`mask_embedding.pt` is DFlash's). The cost is vocab × H more in the file and in memory; the
reference (speculators) trains and ships the whole embedding. Without it the mask token embeds
as the target's (frozen, shared) row.

Training (as vllm-project/speculators' P-EAGLE, models/peagle/: depth 0 at every position, depth
d at anchor t sees the depth-0 keys of positions <= t and its own chain's depths < d) is the
training-time-test stack of EAGLE-3 (eaglenest.drafter.attention) with other inputs: depth 0 is
EAGLE-3's step 0 (aux_t and x_t+1 at rotary position t); depth d >= 1 takes the mask token and
fc(mask_hidden) at rotary position t + d, not the previous step's output. A query's keys are
exactly those of vLLM's parallel forward, so every position of every sample is an anchor at the
cost of K steps of EAGLE-3 TTT (packed rows, sliding windows and checkpointing included).

Its objective is eaglenest.drafter.p_eagle.loss, its export eaglenest.drafter.p_eagle.export.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.eagle3.model import Eagle3Drafter, row_positions
from eaglenest.drafter.layers import TTTStack, shift_left

# ---- the model -------------------------------------------------------------------------------


class PEagleDrafter(Eagle3Drafter):
    """EAGLE-3's drafter drafting depth 0..K-1 in one forward (module doc)."""

    family = "p_eagle"

    def __init__(
        self,
        config: DrafterConfig,
        mask_token_id: int,
        num_hidden_layers: int = 1,
        train_mask_embedding: bool = False,
    ):
        super().__init__(config, num_hidden_layers)
        if not 0 <= mask_token_id < config.vocab_size:
            raise ValueError(
                f"P-EAGLE mask_token_id {mask_token_id} is not a token of the target's "
                f"vocabulary (0..{config.vocab_size - 1})"
            )
        self.mask_token_id = mask_token_id
        # Stands for the aux states of the positions after the first (speculators draws it
        # from N(0, 1), models/peagle/core.py).
        self.mask_hidden = nn.Parameter(
            torch.randn(len(config.aux_layer_ids) * config.target_hidden_size)
        )
        # What training adds to the target's embedding row of the mask token (module doc):
        # zero at the start, so the drafter starts from the target's row, whenever that is
        # loaded.
        self.mask_embedding_delta = (
            nn.Parameter(torch.zeros(config.hidden_size)) if train_mask_embedding else None
        )

    @property
    def num_hidden_layers(self) -> int:
        return 1 + len(self.layers)

    @property
    def train_mask_embedding(self) -> bool:
        return self.mask_embedding_delta is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's embedding, the mask token's row plus the trained delta (wherever the
        mask token is, as vLLM embeds it with the exported table)."""
        embeds = self.embed_tokens(input_ids)
        if self.mask_embedding_delta is None:
            return embeds
        is_mask = (input_ids == self.mask_token_id)[..., None]
        # where() rather than indexing: the delta is in the graph (a zero gradient where no
        # mask token is), so DDP finds every parameter used.
        return torch.where(is_mask, embeds + self.mask_embedding_delta, embeds)

    def mask_embedding(self) -> torch.Tensor:
        """The mask token's input embedding [H] as trained."""
        return self.embed(torch.tensor([self.mask_token_id], device=self.fc.weight.device))[0]

    def parallel_states(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        depths: int,
        segments: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> Iterator[torch.Tensor]:
        """The LM-head input [B, T, H] of depth 0, 1, ..., depths-1 at every position: depth d
        at t drafts the token t + 2 + d, at rotary position p_t + d. `segments` and
        `positions` as in `Eagle3Drafter.forward`."""
        b, t = input_ids.shape
        rows, visible = row_positions(segments, b, t, input_ids.device)
        positions = rows if positions is None else positions
        cache = TTTStack(visible)
        normed, _ = self.step_states(shift_left(input_ids, 1), self.project(aux), positions, cache)
        yield normed
        if depths > 1:
            mask_ids = torch.full_like(input_ids, self.mask_token_id)
            mask_state = self.project(self.mask_hidden).expand(b, t, -1)
            for depth in range(1, depths):
                normed, _ = self.step_states(mask_ids, mask_state, positions + depth, cache)
                yield normed

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        ttt_steps: int,
        own_tokens: bool = False,
        segments: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Logits [B, T, D] of every depth (`ttt_steps` of them), in EAGLE-3's forward's
        signature and alignment, so the training loop's `ttt_forward` and `ttt_loss` take it
        as they are (or `parallel_loss`, this family's weights)."""
        if own_tokens:
            raise ValueError(
                "P-EAGLE's depths take the mask token, never a drafted one: "
                "train.ttt_inputs must be data"
            )
        states = self.parallel_states(aux, input_ids, ttt_steps, segments, positions)
        return [self.lm_head(normed) for normed in states]

    def teacher_forced_states(
        self, aux: torch.Tensor, input_ids: torch.Tensor, ttt_steps: int
    ) -> Iterator[torch.Tensor]:
        """What the evaluation scores as a draft chain: P-EAGLE's depths depend on no drafted
        token, so they are its parallel states."""
        return self.parallel_states(aux, input_ids, ttt_steps)
