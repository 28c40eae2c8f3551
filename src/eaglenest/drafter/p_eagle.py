"""P-EAGLE: EAGLE-3 drafting its K tokens in one forward (arXiv 2602.01469), readable top to
bottom: the model, its training objective, its export.

The model is eaglenest.drafter.model's EAGLE-3 drafter with one more weight, `mask_hidden`
[n_aux·H_target], and a mask token id. vLLM 0.32 serves it as `method: eagle3` with
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

Training (as vllm-project/speculators' P-EAGLE, models/peagle/: depth 0 at every position, depth
d at anchor t sees the depth-0 keys of positions <= t and its own chain's depths < d) is the
training-time-test stack of EAGLE-3 (eaglenest.drafter.attention) with other inputs: depth 0 is
EAGLE-3's step 0 (aux_t and x_t+1 at rotary position t); depth d >= 1 takes the mask token and
fc(mask_hidden) at rotary position t + d, not the previous step's output. A query's keys are
exactly those of vLLM's parallel forward, so every position of every sample is an anchor at the
cost of K steps of EAGLE-3 TTT (packed rows, sliding windows and checkpointing included).

Objective: depth d at position t learns the target's distribution at t + 1 + d (its next
token, x_t+2+d) where position t + 1 + d is in the answer (loss_mask), the target's argmax is a
draft token and (packed rows) t + 1 + d is in t's sample: EAGLE-3's step d's positions
(stages/train/loss.py). speculators trains depth d on a random share max(0.7^d, 0.2) of the
positions (COD sampling, to save memory) and averages the loss over all sampled positions; here
every position is computed and depth d weighted by that share (`cod_depth_weights`): about the
same loss in expectation, without its sampling noise. Unlike speculators (which trains the
embedding for P-EAGLE), the embedding stays the target's, frozen and not exported, so vLLM
embeds the mask token as training did.

Export: the project's EAGLE-3 checkpoint (eaglenest.drafter.export, `LlamaForCausalLMEagle3`)
plus `mask_token_id` and `mask_hidden`; vLLM's loader refuses a parallel-drafting checkpoint
without `mask_hidden` (model_executor/models/llama_eagle3.py:450-455). `parallel_drafting: true`
is written too, for readers; vLLM takes it from `speculative_config` (`speculative_config`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from eaglenest.common.io import write_json
from eaglenest.drafter.block_loss import (
    PositionLoss,
    SlotStats,
    hard_cross_entropy,
    weighted_slot_loss,
)
from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.export import (
    ARCHITECTURE,
    INTEGER_TENSORS,
    ExportError,
    check_captured_layers,
    check_exportable,
    drafter_config_from_export,
    export_config,
    export_drafter,
    is_full_vocab,
)
from eaglenest.drafter.layers import TTTStack
from eaglenest.drafter.model import Eagle3Drafter, shift_left

if TYPE_CHECKING:  # annotations only: the batches' module is deep in the import graph
    from eaglenest.drafter.batches import Batch

FORMAT = "p_eagle/1"
# speculators' COD sampling (models/peagle/core.py, get_trainer_kwargs): depth d keeps a share
# max(COD_RATIO**d, COD_RATIO_MIN) of the positions.
COD_RATIO = 0.7
COD_RATIO_MIN = 0.2
# Where vLLM 0.32 looks for the mask token of a parallel drafter, first found first
# (v1/spec_decode/llm_base_proposer.py:356-379).
MASK_TOKEN_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")


# ---- the model -------------------------------------------------------------------------------


class PEagleDrafter(Eagle3Drafter):
    """EAGLE-3's drafter drafting depth 0..K-1 in one forward (module doc)."""

    def __init__(self, config: DrafterConfig, mask_token_id: int):
        super().__init__(config)
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

    def parallel_states(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        depths: int,
        segments: torch.Tensor | None = None,
    ) -> Iterator[torch.Tensor]:
        """The LM-head input [B, T, H] of depth 0, 1, ..., depths-1 at every position: depth d
        at t drafts the token t + 2 + d. `segments` as in `Eagle3Drafter.forward`."""
        b, t = input_ids.shape
        positions, visible = row_positions(segments, b, t, input_ids.device)
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
    ) -> list[torch.Tensor]:
        """Logits [B, T, D] of every depth (`ttt_steps` of them), in EAGLE-3's forward's
        signature and alignment, so the training loop's `ttt_forward` and `ttt_loss` take it
        as they are (or `parallel_loss`, this family's weights)."""
        if own_tokens:
            raise ValueError(
                "P-EAGLE's depths take the mask token, never a drafted one: "
                "train.ttt_inputs must be data"
            )
        states = self.parallel_states(aux, input_ids, ttt_steps, segments)
        return [self.lm_head(normed) for normed in states]

    def teacher_forced_states(
        self, aux: torch.Tensor, input_ids: torch.Tensor, ttt_steps: int
    ) -> Iterator[torch.Tensor]:
        """What the evaluation scores as a draft chain: P-EAGLE's depths depend on no drafted
        token, so they are its parallel states."""
        return self.parallel_states(aux, input_ids, ttt_steps)


def row_positions(
    segments: torch.Tensor | None, b: int, t: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary positions [B, T] (from 0 in each sample of a packed row) and the step-0 keys
    each query may see ([B, 1, T, T], causal within its sample; None for one sample a row), as
    `Eagle3Drafter.forward` builds them."""
    positions = torch.arange(t, device=device).expand(b, t)
    if segments is None:
        return positions, None
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    positions = positions - torch.where(starts, positions, 0).cummax(-1).values
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return positions, (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]


# ---- the training objective ------------------------------------------------------------------


def cod_depth_weights(
    depths: int, ratio: float = COD_RATIO, floor: float = COD_RATIO_MIN
) -> list[float]:
    """The expected share of positions speculators' COD sampling trains at each depth."""
    return [1.0] + [max(ratio**d, floor) for d in range(1, depths)]


def depth_valid(batch: Batch, depths: int) -> list[torch.Tensor]:
    """[B, T] bool per depth d: position t's depth-d draft is trained (module doc)."""
    valid = []
    for d in range(depths):
        v = shift_left(batch.loss_mask, 1 + d, False) & shift_left(
            batch.in_draft_vocab, 1 + d, False
        )
        if batch.segments is not None:
            v = v & (shift_left(batch.segments, 1 + d, -1) == batch.segments)
        valid.append(v)
    return valid


def parallel_loss(
    depth_logits: list[torch.Tensor],
    batch: Batch,
    depth_weights: Sequence[float] | None = None,
    position_loss: PositionLoss = hard_cross_entropy,
    denominator: float | None = None,
) -> tuple[torch.Tensor, SlotStats]:
    """P-EAGLE's loss over the depths' logits [B, T, D] (`PEagleDrafter.forward`), the batch's
    target signal filled: sum_d w_d (sum of depth d's losses) / sum_d w_d n_d, n_d the depth's
    trained positions, w_d `cod_depth_weights` unless given. `denominator`: sum_d w_d n_d over
    every rank, under DDP."""
    weights = list(depth_weights or cod_depth_weights(len(depth_logits)))
    if len(weights) != len(depth_logits):
        raise ValueError(f"{len(depth_logits)} depths but {len(weights)} depth weights")
    valid = depth_valid(batch, len(depth_logits))
    if denominator is None:
        denominator = sum(w * int(v.sum()) for w, v in zip(weights, valid, strict=True))
    slots = (
        (logits, shift_left(batch.target_logits, 1 + d), valid[d])
        for d, logits in enumerate(depth_logits)
    )
    return weighted_slot_loss(slots, weights, denominator, position_loss)


# ---- the export --------------------------------------------------------------------------------


def check_p_eagle_exportable(config: DrafterConfig) -> None:
    """Before training: a P-EAGLE drafter vLLM 0.32 could not serve as trained."""
    check_exportable(config)
    if config.attention != "llama":
        raise ExportError(
            f"P-EAGLE with attention {config.attention}: vLLM's MLA EAGLE-3 drafter "
            "(deepseek_eagle3.py) has no mask_hidden and drafts no parallel tokens; "
            "use attention: llama"
        )


def p_eagle_export_config(model: PEagleDrafter, dtype: str, depths: int) -> dict[str, Any]:
    """config.json: the EAGLE-3 export's, with the mask token and the trained depths."""
    check_p_eagle_exportable(model.config)
    config = export_config(model.config, dtype)
    config["mask_token_id"] = model.mask_token_id
    config["parallel_drafting"] = True  # for readers; vLLM reads speculative_config's
    config["eaglenest"] = {
        **config["eaglenest"],
        "format": FORMAT,
        "mask_token_id": model.mask_token_id,
        "depths": depths,
    }
    return config


def export_p_eagle(
    model: PEagleDrafter, out_dir: str | Path, depths: int, dtype: str = "bfloat16"
) -> None:
    """config.json + model.safetensors, vLLM's EAGLE-3 names plus `mask_hidden`."""
    config = p_eagle_export_config(model, dtype, depths)
    p_eagle_from_export(config)  # what vLLM would read is what was trained, or no export
    # The EAGLE-3 export writes every trainable tensor (mask_hidden among them, [n_aux·H]),
    # then its own config.json, which this family's replaces.
    export_drafter(model, out_dir, dtype=dtype)
    write_json(Path(out_dir) / "config.json", config)


def vllm_mask_token_id(config: dict[str, Any]) -> int | None:
    """The mask token vLLM 0.32 drafts with for this config.json (llm_base_proposer.py:356-379):
    dflash_config's first, then the first of MASK_TOKEN_KEYS present."""
    nested = config.get("dflash_config") or {}
    if "mask_token_id" in nested:
        return nested["mask_token_id"]
    for key in MASK_TOKEN_KEYS:
        if config.get(key) is not None:
            return config[key]
    return None


def p_eagle_from_export(config: dict[str, Any]) -> tuple[DrafterConfig, int, int]:
    """(drafter config, mask token id, trained depths) of a P-EAGLE config.json, refused where
    vLLM 0.32 would read another drafter than the one recorded as trained (`eaglenest`)."""
    trained = config.get("eaglenest") or {}
    if trained.get("format") != FORMAT:
        raise ExportError(f"config.json: eaglenest.format {trained.get('format')!r}, not {FORMAT}")
    if config.get("architectures") != [ARCHITECTURE]:
        raise ExportError(
            f"config.json: architectures {config.get('architectures')} but P-EAGLE is exported "
            f"as [{ARCHITECTURE!r}] (vLLM's Eagle3LlamaForCausalLM reads mask_hidden)"
        )
    if config.get("num_hidden_layers") != 1:
        raise ExportError(
            f"config.json: num_hidden_layers {config.get('num_hidden_layers')}, trained 1"
        )
    served = vllm_mask_token_id(config)
    if served != trained.get("mask_token_id"):
        raise ExportError(
            f"config.json: vLLM would draft with mask token {served} (dflash_config."
            "mask_token_id, mask_token_id, dspark_noise_token_id, pard_token, ptd_token_id, "
            f"first found) but the drafter was trained with {trained.get('mask_token_id')}"
        )
    drafter = drafter_config_from_export(config)
    if list(drafter.aux_layer_ids) != list(trained.get("aux_layer_ids", [])):
        raise ExportError(
            f"config.json: vLLM would capture layers {list(drafter.aux_layer_ids)} "
            f"(eagle_aux_hidden_state_layer_ids) but the drafter was trained on "
            f"{trained.get('aux_layer_ids')}"
        )
    return drafter, served, int(trained["depths"])


def load_p_eagle(
    drafter_dir: str | Path,
    embed: torch.Tensor,
    expect_layer_ids: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[PEagleDrafter, int]:
    """The drafter of an export (its embedding from the target) and its trained depths."""
    drafter_dir = Path(drafter_dir)
    config, mask_token_id, depths = p_eagle_from_export(
        json.loads((drafter_dir / "config.json").read_text())
    )
    check_captured_layers(drafter_dir, config.aux_layer_ids, expect_layer_ids)
    model = PEagleDrafter(config, mask_token_id)
    with safe_open(str(drafter_dir / "model.safetensors"), framework="pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    if "mask_hidden" not in state or state["mask_hidden"].numel() != model.mask_hidden.numel():
        raise ExportError(
            f"{drafter_dir / 'model.safetensors'}: no mask_hidden of "
            f"{model.mask_hidden.numel()} values (n_aux x target_hidden_size), which vLLM "
            "needs to draft in parallel (llama_eagle3.py:440-455)"
        )
    state["mask_hidden"] = state["mask_hidden"].reshape(-1)
    state["embed_tokens.weight"] = embed
    if is_full_vocab(config) and "d2t" not in state:  # the identity mapping (export.py)
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    model.load_state_dict({k: v if k in INTEGER_TENSORS else v.to(dtype) for k, v in state.items()})
    return model.to(dtype), depths


def speculative_config(drafter_dir: str | Path, k: int, depths: int) -> dict[str, Any]:
    """vLLM's `speculative_config` serving the export with K drafted tokens (K <= depths)."""
    if not 1 <= k <= depths:
        raise ValueError(f"P-EAGLE trained {depths} depths: it drafts 1..{depths} tokens, not {k}")
    return {
        "method": "eagle3",
        "model": str(drafter_dir),
        "num_speculative_tokens": k,
        "parallel_drafting": True,
    }
