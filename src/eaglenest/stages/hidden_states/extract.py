"""Hidden states of the target, packed per shard and streamed to disk (the `hidden` stage).

For every sample of a tokens shard the target runs once and we keep:
- `aux` [T, 3H]: the INPUT of the decoder layers `aux_layer_ids` (vLLM's
  `eagle_aux_hidden_state_layer_ids`, default (2, N//2, N-3)) = transformers
  `output_hidden_states[k]`, captured with forward pre-hooks (all hidden states are never kept);
- the target signal of the loss: `final_hidden` [T, H] (output of the final norm) or the top-k
  logits (`topk_ids` int32 + `topk_values` float32, [T, k]); the LM head runs only for top-k;
- `input_ids` [T] int64, `loss_mask` [T] uint8 and `offsets` [N+1] int64 (sample i is rows
  offsets[i]:offsets[i+1]), samples in the order of the tokens shard.

Storage dtypes of aux/final_hidden: `bf16`, `fp32` (exact; tests) or `fp8` = float8_e4m3fn with a
float32 scale per token and per layer block (`aux_scale` [T, 3], `final_hidden_scale` [T]),
scale = amax / 448, so each layer's row keeps its own range (layers differ in magnitude).

The file is a plain safetensors file laid out before the forward passes (shapes follow from the
tokens shard), then filled in place with positioned writes as batches come: memory stays bounded
by one batch whatever the shard size. Positioned writes (os.pwrite) rather than a memmap, because
a memmap's dirty pages count in the job's resident memory until they are flushed. It is written
to a temporary file beside the target and renamed at the end, so a killed job leaves nothing that
passes as complete.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglenest.common.batching import pack_batches
from eaglenest.common.io import library_versions, sha256_file, write_json
from eaglenest.formats.hidden_shard import (
    FORMAT,
    ShardWriter,
    bytes_per_token,
    create_hidden_shard,
    tensor_specs,
)
from eaglenest.settings.hidden import HiddenSettings
from eaglenest.target.loading import (
    decoder_layers,
    default_aux_layer_ids,
    load_target,
    target_config_hash,
    text_config,
)

log = logging.getLogger(__name__)

TOPK_CHUNK_ROWS = 2048  # rows of logits computed at once for top-k


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


def shard_metadata(
    *,
    model_config,
    backend: str,
    target_path: str | Path,
    target_name: str,
    layer_ids: tuple[int, ...],
    settings: HiddenSettings,
    tokens_sha256: str,
    sample_ids: list[str],
    model_dtype: str,
) -> dict[str, str]:
    return {
        "format": FORMAT,
        "backend": backend,
        "target_name": target_name,
        "target_path": str(target_path),
        "target_config_sha256": target_config_hash(target_path),
        "aux_layer_ids": json.dumps(list(layer_ids)),
        "num_hidden_layers": str(model_config.num_hidden_layers),
        "hidden_size": str(model_config.hidden_size),
        "vocab_size": str(model_config.vocab_size),
        "dtype": settings.dtype,
        "model_dtype": model_dtype.removeprefix("torch."),
        "target_signal": settings.target_signal,
        "top_k": str(settings.top_k),
        "tokens_sha256": tokens_sha256,
        "versions": json.dumps(library_versions(), sort_keys=True),
        "sample_ids": json.dumps(sample_ids),
    }


def checked_aux_layer_ids(model_config, settings: HiddenSettings) -> tuple[int, ...]:
    """The decoder layers whose input is kept: the settings' or the default, checked against the
    target's config (and top_k against its vocabulary)."""
    n_layers = model_config.num_hidden_layers
    layer_ids = settings.aux_layer_ids or default_aux_layer_ids(n_layers)
    if len(layer_ids) != 3 or not all(0 <= k < n_layers for k in layer_ids):
        raise ValueError(f"hidden.aux_layer_ids {list(layer_ids)}: need 3 ids in [0, {n_layers})")
    if settings.target_signal == "topk" and settings.top_k > model_config.vocab_size:
        raise ValueError(f"hidden.top_k {settings.top_k} > vocabulary {model_config.vocab_size}")
    return tuple(layer_ids)


def log_planned_size(tokens: str | Path, n_samples: int, n_tokens: int, specs) -> None:
    """Before any capture: what the shard will take on disk (bytes per token x tokens)."""
    per_token = bytes_per_token(specs)
    log.info(
        "%s: %d samples, %d tokens; the hidden-state shard will take %.1f MB (%d bytes/token)",
        tokens, n_samples, n_tokens, per_token * n_tokens / 1e6, per_token,
    )  # fmt: skip


@dataclass(frozen=True)
class ShardPlan:
    """What a hidden-state shard will hold, known before any forward pass: from the tokens shard
    and the target's (text) config."""

    frame: Any  # the tokens frame
    layer_ids: tuple[int, ...]
    hidden_size: int
    lengths: np.ndarray
    offsets: np.ndarray
    specs: list

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])


def plan_hidden_shard(tokens: str | Path, model_config, settings: HiddenSettings) -> ShardPlan:
    """The shard's layout from the target's text config (Kimi-K2.5 nests it as `text_config`):
    aux layer ids, hidden size, tensor specs; logs the size it will take on disk."""
    from eaglenest.formats.tokens import read_tokens  # polars: see sample_rows

    config = text_config(model_config)
    frame = read_tokens(tokens)
    layer_ids = checked_aux_layer_ids(config, settings)
    lengths, offsets = sample_offsets(frame)
    n_tokens = int(offsets[-1])
    specs = tensor_specs(len(frame), n_tokens, config.hidden_size, len(layer_ids), settings)
    log_planned_size(tokens, len(frame), n_tokens, specs)
    return ShardPlan(frame, layer_ids, config.hidden_size, lengths, offsets, specs)


def sample_offsets(frame) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, offsets) of the tokens frame's samples in the packed shard."""
    lengths = frame["n_tokens"].to_numpy()
    offsets = np.zeros(len(frame) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return lengths, offsets


def sample_rows(input_ids, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample's input_ids [n] int64 and loss_mask [n] uint8 rows."""
    # formats.tokens (polars, pandera) imported here, not at the top: the capture itself
    # (AuxCapture, forward_batch) runs where only torch and transformers are (bench/gpu_check.py).
    from eaglenest.formats.tokens import loss_mask

    ids = torch.from_numpy(np.array(input_ids, dtype=np.int64))  # a copy: parquet's is read-only
    mask = torch.from_numpy(loss_mask(prompt_len, len(ids)).astype(np.uint8))
    return ids, mask


def shard_summary(
    *, frame, n_tokens: int, out: str | Path, layer_ids, settings: HiddenSettings,
    hidden_size: int, seconds: float, forward_s: float, backend: str,
    summary_out: str | Path | None,
) -> dict[str, Any]:  # fmt: skip
    size = Path(out).stat().st_size
    summary = {
        "backend": backend,
        "samples": len(frame),
        "tokens": n_tokens,
        "bytes": size,
        "bytes_per_token": size / n_tokens if n_tokens else None,
        "hidden_size": hidden_size,
        "aux_layer_ids": list(layer_ids),
        "dtype": settings.dtype,
        "target_signal": settings.target_signal,
        "seconds": round(seconds, 3),
        "forward_seconds": round(forward_s, 3),
        "tokens_per_s": round(n_tokens / seconds, 1) if seconds else None,
        # the target's own time: forward passes, or vLLM's generate calls (its start aside)
        "forward_tokens_per_s": round(n_tokens / forward_s, 1) if forward_s else None,
    }
    log.info(
        "hidden states (%s): %d samples, %d tokens, %.1f bytes/token (%s, %s), %.1f tokens/s",
        backend, len(frame), n_tokens, summary["bytes_per_token"] or 0, settings.dtype,
        settings.target_signal, summary["tokens_per_s"] or 0,
    )  # fmt: skip
    if summary_out is not None:
        write_json(summary_out, summary)
    return summary


def write_samples(
    writer: ShardWriter,
    model,
    capture: AuxCapture,
    frame,
    lengths: np.ndarray,
    offsets: np.ndarray,
    settings: HiddenSettings,
) -> float:
    """Every sample of the tokens frame through the target, in packed batches, its rows written
    at offsets[i]; returns the seconds spent in the forward passes."""
    input_ids = frame["input_ids"].to_list()
    prompt_lens = frame["prompt_len"].to_list()
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
    target_path: str | Path,
    out: str | Path,
    settings: HiddenSettings,
    target_name: str = "",
    trust_remote_code: bool = False,
    summary_out: str | Path | None = None,
    model=None,
) -> dict[str, Any]:
    """Run the target over a tokens shard and write its hidden-state shard; returns the summary."""
    started = time.perf_counter()
    if model is None:
        model = load_target(target_path, settings.device, settings.model_dtype, trust_remote_code)
    plan = plan_hidden_shard(tokens, model.config, settings)
    frame, layer_ids, lengths, offsets = plan.frame, plan.layer_ids, plan.lengths, plan.offsets
    hidden_size, n_tokens, specs = plan.hidden_size, plan.n_tokens, plan.specs
    metadata = shard_metadata(
        model_config=text_config(model.config),
        backend="transformers",
        target_path=target_path,
        target_name=target_name,
        layer_ids=layer_ids,
        settings=settings,
        tokens_sha256=sha256_file(tokens),
        sample_ids=frame["id"].to_list(),
        model_dtype=str(next(model.parameters()).dtype),
    )
    capture = AuxCapture(model, layer_ids)
    try:
        with create_hidden_shard(out, specs, metadata, settings, len(layer_ids)) as writer:
            writer.write("offsets", 0, torch.from_numpy(offsets))
            forward_s = write_samples(writer, model, capture, frame, lengths, offsets, settings)
    finally:
        capture.remove()
    return shard_summary(
        frame=frame, n_tokens=n_tokens, out=out, layer_ids=layer_ids, settings=settings,
        hidden_size=hidden_size, seconds=time.perf_counter() - started, forward_s=forward_s,
        backend="transformers", summary_out=summary_out,
    )  # fmt: skip
