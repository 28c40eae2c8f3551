"""What both backends of the hidden-state stage share: the plan of a shard, its writer, its end.

    plan = plan_hidden_shard(tokens, model_config, settings)   # before any forward pass
    output = ShardOutput(out, summary_out, backend, target_path, target_name)
    with open_shard(output, plan, settings, model_dtype) as writer:
        ...  # the backend writes each planned sample's rows (writer.write_sample)
    return finish_shard(output, plan, settings, started, forward_s)  # the summary JSON

The plan follows from the tokens shard and the target's (text) config alone: aux layer ids
(`hidden.aux_layer_ids`, else the union of train.families' defaults), the samples' offsets in the packed
shard, the tensor specs and so the size on disk, logged before anything runs. The shard file
(formats/hidden_shard.py) is laid out from it at a temporary path and renamed when the writer
closes, so a killed job leaves nothing that passes as complete; the metadata names the backend.
Rows are positioned writes (os.pwrite), not a memmap: a memmap's dirty pages count in the job's
resident memory until they are flushed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglenest.common.io import library_versions, sha256_file, write_json
from eaglenest.formats.hidden_shard import (
    FORMAT,
    ShardWriter,
    bytes_per_token,
    create_hidden_shard,
    tensor_specs,
)
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.target_model.loading import checked_aux_layer_ids, target_config_hash, text_config

log = logging.getLogger(__name__)


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
    tokens: Path
    model_config: Any  # the target's text config

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])


def plan_hidden_shard(tokens: str | Path, model_config, settings: HiddenSettings) -> ShardPlan:
    """The shard's layout from the target's text config (Kimi-K2.5 nests it as `text_config`):
    aux layer ids, hidden size, tensor specs; logs the size it will take on disk."""
    from eaglenest.formats.tokens import read_tokens  # polars: see capture/answer.sample_rows

    config = text_config(model_config)
    frame = read_tokens(tokens)
    layer_ids = checked_aux_layer_ids(config, settings)
    lengths, offsets = sample_offsets(frame)
    n_tokens = int(offsets[-1])
    specs = tensor_specs(len(frame), n_tokens, config.hidden_size, len(layer_ids), settings)
    per_token = bytes_per_token(specs)
    log.info(
        "%s: %d samples, %d tokens; the hidden-state shard will take %.1f MB (%d bytes/token)",
        *(tokens, len(frame), n_tokens, per_token * n_tokens / 1e6, per_token),
    )
    return ShardPlan(
        frame, layer_ids, config.hidden_size, lengths, offsets, specs, Path(tokens), config
    )


def sample_offsets(frame) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, offsets) of the tokens frame's samples in the packed shard."""
    lengths = frame["n_tokens"].to_numpy()
    offsets = np.zeros(len(frame) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return lengths, offsets


@dataclass(frozen=True)
class ShardOutput:
    """The shard a backend writes: where it and its summary go, and what its metadata names."""

    out: str | Path
    summary_out: str | Path | None
    backend: str  # "transformers" or "vllm"
    target_path: str | Path
    target_name: str


def shard_metadata(
    output: ShardOutput, plan: ShardPlan, settings: HiddenSettings, model_dtype: str
) -> dict[str, str]:
    config = plan.model_config
    return {
        "format": FORMAT,
        "backend": output.backend,
        "target_name": output.target_name,
        "target_path": str(output.target_path),
        "target_config_sha256": target_config_hash(output.target_path),
        "aux_layer_ids": json.dumps(list(plan.layer_ids)),
        "num_hidden_layers": str(config.num_hidden_layers),
        "hidden_size": str(config.hidden_size),
        "vocab_size": str(config.vocab_size),
        "dtype": settings.dtype,
        "model_dtype": model_dtype.removeprefix("torch."),
        "target_signal": settings.target_signal,
        "top_k": str(settings.top_k),
        "tokens_sha256": sha256_file(plan.tokens),
        "versions": json.dumps(library_versions(), sort_keys=True),
        "sample_ids": json.dumps(plan.frame["id"].to_list()),
    }


@contextlib.contextmanager
def open_shard(
    output: ShardOutput, plan: ShardPlan, settings: HiddenSettings, model_dtype: str
) -> Iterator[ShardWriter]:
    """The planned shard laid out beside `output.out`, its offsets written; yields the writer the
    backend fills with every sample's rows, and renames the file to `output.out` when the block
    ends without an error."""
    metadata = shard_metadata(output, plan, settings, model_dtype)
    n_aux = len(plan.layer_ids)
    with create_hidden_shard(output.out, plan.specs, metadata, settings, n_aux) as writer:
        writer.write("offsets", 0, torch.from_numpy(plan.offsets))
        yield writer


def finish_shard(
    output: ShardOutput, plan: ShardPlan, settings: HiddenSettings, started: float, forward_s: float
) -> dict[str, Any]:
    """The summary of a written shard (sizes, rates; `started` is the job's perf_counter at its
    start), logged, written to `output.summary_out` when given, returned."""
    seconds = time.perf_counter() - started
    n_tokens, size = plan.n_tokens, Path(output.out).stat().st_size
    backend = output.backend
    summary = {
        "backend": backend,
        "samples": len(plan.frame),
        "tokens": n_tokens,
        "bytes": size,
        "bytes_per_token": size / n_tokens if n_tokens else None,
        "hidden_size": plan.hidden_size,
        "aux_layer_ids": list(plan.layer_ids),
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
        *(backend, len(plan.frame), n_tokens, summary["bytes_per_token"] or 0),
        *(settings.dtype, settings.target_signal, summary["tokens_per_s"] or 0),
    )
    if output.summary_out is not None:
        write_json(output.summary_out, summary)
    return summary
