"""A capture server's answer for one sample (vLLM's per-request state file, written by our
connector, vllm_engine/connector.py; read by capture/state_file.py) turned into the rows a
hidden-state shard holds, its token ids checked against the sample's. The one
conversion of the capture stage (stages/hidden_states/vllm_backend.py) and of the jobs that ask
the capture servers for states instead of reading files (capture/reader.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class StateFileError(ValueError):
    """A state file holds other tokens or rows than the sample sent; the message names it."""


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
    hidden = states["hidden_states"]  # [T, 4, H]: the aux layers, then layer N
    if hidden.shape[0] != len(ids):
        raise StateFileError(
            f"{tokens}: sample {frame['id'][i]!r} (row {i}): vLLM's state file has "
            f"{hidden.shape[0]} rows for {len(ids)} tokens"
        )
    aux = hidden[:, :3, :].reshape(hidden.shape[0], -1)
    return aux, signal(hidden[:, 3, :]), ids, mask
