"""A capture server's answer for one sample (vLLM's per-request state file, written by our
connector, vllm_engine/connector.py; read by capture/state_file.py) turned into the rows a
hidden-state shard holds, its token ids checked against the sample's. The one
conversion of the capture stage (stages/hidden_states/vllm_backend.py) and of the jobs that ask
the capture servers for states instead of reading files (capture/reader.py).

`check_states` checks a file as it is read, before anything is packed: the layer count, width
and dtype the run expects (ExpectedStates), finite values, and the token ids sent. A file that
fails is the server's fault (StateFileError is a ServerFault): the capture pool sends the sample
to another server.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglenest.capture.faults import ServerFault

# What vLLM's capture writes hidden states in (its cache-only attention's dtypes).
STATE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class StateFileError(ServerFault, ValueError):
    """A state file holds other tokens, rows, layers, widths, dtype or values than the sample
    sent calls for; the message names it."""


@dataclass(frozen=True)
class ExpectedStates:
    """What every state file of a run holds: `hidden_states` [T, layers, hidden_size] in
    `dtype` (None: any of STATE_DTYPES, where the model's dtype is vLLM's choice)."""

    layers: int  # the aux layers, then layer N
    hidden_size: int
    dtype: torch.dtype | None

    @classmethod
    def of(cls, layers: int, hidden_size: int, model_dtype: str, engine_args: dict[str, Any]):
        """The states of a run whose target runs in `model_dtype` with vLLM's `engine_args`
        (a kv_cache_dtype of its own is the dtype the states are cached, and written, in)."""
        named = engine_args.get("kv_cache_dtype") or model_dtype
        return cls(layers, int(hidden_size), STATE_DTYPES.get(str(named)))


def check_states(states: dict, expected: ExpectedStates, sent_ids, path: str) -> None:
    """Raise StateFileError naming `path` unless its tensors are what `expected` and the token
    ids sent (`sent_ids`) call for."""
    hidden, ids = states.get("hidden_states"), states.get("token_ids")
    if hidden is None or ids is None:
        raise StateFileError(f"{path}: no hidden_states or token_ids tensor in the state file")
    shape = (len(sent_ids), expected.layers, expected.hidden_size)
    if tuple(hidden.shape) != shape:
        raise StateFileError(
            f"{path}: hidden_states of shape {tuple(hidden.shape)}, expected {shape} "
            "(tokens, aux layers and layer N, hidden size)"
        )
    allowed = [expected.dtype] if expected.dtype else list(STATE_DTYPES.values())
    if hidden.dtype not in allowed:
        raise StateFileError(
            f"{path}: hidden_states in {hidden.dtype}, expected {' or '.join(map(str, allowed))}"
        )
    if not torch.isfinite(hidden).all():
        bad = int((~torch.isfinite(hidden)).any(-1).any(-1).nonzero()[0])
        raise StateFileError(f"{path}: hidden_states not finite (first at token {bad})")
    if ids.tolist() != list(np.asarray(sent_ids).tolist()):
        raise StateFileError(f"{path}: token_ids are not the {len(sent_ids)} token ids sent")


def sample_rows(input_ids, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample's input_ids [n] int64 and loss_mask [n] uint8 rows."""
    # formats.tokens (polars, pandera) imported here, not at the top: the transformers capture
    # (extract.AuxCapture, forward_batch) runs where only torch and transformers are
    # (bench/gpu_check.py).
    from eaglenest.formats.tokens import loss_mask

    ids = torch.from_numpy(np.array(input_ids, dtype=np.int64))  # a copy: parquet's is read-only
    mask = torch.from_numpy(loss_mask(prompt_len, len(ids)).astype(np.uint8))
    return ids, mask


def request_rows(frame, i: int, states, signal, tokens: Path) -> tuple:
    """(aux, target signal, input_ids, loss_mask) of sample `i` of a tokens frame from its state
    file's tensors (capture/state_file.py, `read_request_file`), its token ids checked against the sample's: what
    `ShardWriter.write_sample` and `formats.hidden_shard.stored_rows` take. Shared by the capture
    stage and by training from the capture servers (hidden.store none), so both pack alike."""
    ids, mask = sample_rows(frame["input_ids"][i].to_numpy(), frame["prompt_len"][i])
    returned = states["token_ids"].to(torch.int64)
    if not torch.equal(returned, ids):
        same = min(len(returned), len(ids))
        differ = (returned[:same] != ids[:same]).nonzero()
        where = int(differ[0]) if len(differ) else same
        raise StateFileError(
            f"{tokens}: sample {frame['id'][i]!r} (row {i}): vLLM returned states for other "
            f"tokens than were sent ({len(returned)} vs {len(ids)} tokens, first difference at "
            f"position {where})"
        )
    hidden = states["hidden_states"]  # [T, n + 1, H]: the n aux layers, then layer N
    if hidden.shape[0] != len(ids):
        raise StateFileError(
            f"{tokens}: sample {frame['id'][i]!r} (row {i}): vLLM's state file has "
            f"{hidden.shape[0]} rows for {len(ids)} tokens"
        )
    aux = hidden[:, :-1, :].reshape(hidden.shape[0], -1)
    return aux, signal(hidden[:, -1, :]), ids, mask
