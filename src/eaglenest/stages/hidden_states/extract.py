"""The transformers backend of the hidden-state stage (`hidden.backend: transformers`): the target
runs in transformers in this process, and fills the shard that plan.py lays out.

For every sample of a tokens shard the target runs once and we keep:
- `aux` [T, n·H]: the INPUT of the n decoder layers `aux_layer_ids` (vLLM's
  `eagle_aux_hidden_state_layer_ids`; default the union of train.families' defaults, vLLM's
  (2, N//2, N-3) for EAGLE-3 alone: settings/families.py `captured_layer_ids`) = transformers
  `output_hidden_states[k]`, captured with forward pre-hooks (all hidden states are never kept);
- the target signal of the loss: `final_hidden` [T, H] (output of the final norm) or the top-k
  logits (`topk_ids` int32 + `topk_values` float32, [T, k]); the LM head runs only for top-k;
- `input_ids` [T] int64, `loss_mask` [T] uint8 and `offsets` [N+1] int64 (sample i is rows
  offsets[i]:offsets[i+1]), samples in the order of the tokens shard.

Samples go through in packed batches (common/batching.py); each batch's rows are written as it
comes, so memory stays bounded by one batch whatever the shard size.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglenest.capture.answer import sample_rows
from eaglenest.common.batching import pack_batches
from eaglenest.formats.hidden_shard import TOPK_CHUNK_ROWS, ShardWriter
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.stages.hidden_states.plan import (
    ShardOutput,
    ShardPlan,
    finish_shard,
    open_shard,
    plan_hidden_shard,
)
from eaglenest.target_model.loading import decoder_layers, load_target

# --- capture ----------------------------------------------------------------------------------


class AuxCapture:
    """Forward pre-hooks that keep the input of the chosen decoder layers."""

    def __init__(self, model, layer_ids: tuple[int, ...]):
        self.layer_ids = layer_ids
        self.captured: dict[int, torch.Tensor] = {}
        layers = decoder_layers(model)
        self.handles = [
            layers[k].register_forward_pre_hook(self._hook(k), with_kwargs=True) for k in layer_ids
        ]

    def _hook(self, k: int):
        def hook(module, args, kwargs):
            self.captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def take(self) -> list[torch.Tensor]:
        states = [self.captured.pop(k) for k in self.layer_ids]
        return states

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.inference_mode()
def forward_batch(
    model, capture: AuxCapture, batch_ids: list[np.ndarray], settings: HiddenSettings
) -> dict[str, torch.Tensor]:
    """One right-padded batch through the target: padded [B, L, ...] tensors on the model's device."""
    device = model.model.embed_tokens.weight.device
    longest = max(len(ids) for ids in batch_ids)
    input_ids = torch.zeros((len(batch_ids), longest), dtype=torch.long)
    attention_mask = torch.zeros((len(batch_ids), longest), dtype=torch.long)
    for row, ids in enumerate(batch_ids):
        input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    outputs = model.model(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
    )
    final = outputs.last_hidden_state  # output of model.model.norm
    aux = capture.take()
    result = {"aux": torch.cat([a.to(final.device) for a in aux], dim=-1)}
    if settings.target_signal == "topk":
        # Logits a chunk of rows at a time: [B, L, V] in float32 would not fit for a large vocabulary.
        rows = final.reshape(-1, final.shape[-1])
        values, ids = [], []
        for chunk in rows.split(TOPK_CHUNK_ROWS):
            top = torch.topk(model.lm_head(chunk).float(), settings.top_k, dim=-1)
            values.append(top.values)
            ids.append(top.indices.to(torch.int32))
        shape = (*final.shape[:2], settings.top_k)
        result["topk_ids"] = torch.cat(ids).reshape(shape)
        result["topk_values"] = torch.cat(values).reshape(shape)
    else:
        result["final_hidden"] = final
    # One transfer per batch, not one per sample and tensor.
    return {name: value.cpu() for name, value in result.items()}


# --- the stage --------------------------------------------------------------------------------


def write_samples(
    writer: ShardWriter, model, capture: AuxCapture, plan: ShardPlan, settings: HiddenSettings
) -> float:
    """Every sample of the plan through the target, in packed batches, its rows written at
    offsets[i]; returns the seconds spent in the forward passes."""
    input_ids = plan.frame["input_ids"].to_list()
    prompt_lens = plan.frame["prompt_len"].to_list()
    lengths, offsets = plan.lengths, plan.offsets
    forward_s = 0.0
    for batch in pack_batches(lengths, settings.max_batch_tokens):
        batch_ids = [np.asarray(input_ids[i], dtype=np.int64) for i in batch]
        tick = time.perf_counter()
        result = forward_batch(model, capture, batch_ids, settings)
        forward_s += time.perf_counter() - tick
        for row, i in enumerate(batch):
            n = int(lengths[i])
            signal = {k: v[row, :n] for k, v in result.items() if k != "aux"}
            ids, mask = sample_rows(batch_ids[row], prompt_lens[i])
            writer.write_sample(int(offsets[i]), result["aux"][row, :n], signal, ids, mask)
    return forward_s


def extract_hidden_states(
    *,
    tokens: str | Path,
    out: str | Path,
    settings: HiddenSettings,
    summary_out: str | Path | None = None,
    model=None,
) -> dict[str, Any]:
    """Run the target (settings.target, unless `model` is given loaded) over a tokens shard and
    write its hidden-state shard; returns the summary."""
    started = time.perf_counter()
    target = settings.target
    if model is None:
        model = load_target(
            target.path, settings.device, settings.model_dtype, target.trust_remote_code
        )
    plan = plan_hidden_shard(tokens, model.config, settings)
    output = ShardOutput(out, summary_out, "transformers", target.path, target.model)
    capture = AuxCapture(model, plan.layer_ids)
    try:
        with open_shard(output, plan, settings, str(next(model.parameters()).dtype)) as writer:
            forward_s = write_samples(writer, model, capture, plan, settings)
    finally:
        capture.remove()
    return finish_shard(output, plan, settings, started, forward_s)
