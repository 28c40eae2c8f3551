"""The hidden-state shard, `hidden/{shard}.safetensors`: its layout, writer and reader.

One safetensors file per tokens shard packs every sample along tokens: `aux` [T, n·H] (the input of
the n aux decoder layers, side by side in the captured order), the target signal (`final_hidden` [T, H], or `topk_ids`/`topk_values`
[T, k]), `input_ids` [T], `loss_mask` [T] and `offsets` [N+1] (sample i is rows
offsets[i]:offsets[i+1]), with metadata (format, layer ids, hidden size, dtype, ...).

Storage dtypes of aux/final_hidden: `bf16`, `fp32` (exact; tests) or `fp8` = float8_e4m3fn with a
float32 scale per token and per layer block (`aux_scale` [T, 3], `final_hidden_scale` [T]),
scale = amax / 448, so each layer's row keeps its own range.

Writing: the header is laid out first (`tensor_specs`, `safetensors_header`), then rows are filled
in place with positioned writes (`ShardWriter`), so memory stays bounded by one batch.
Reading: `open_hidden_shard` checks the metadata against what the caller expects (layer ids,
hidden size) and raises a ValueError naming the file, the field, the expected and the found value;
`sample(i)` reads only rows offsets[i]:offsets[i+1] (safetensors `get_slice`) and dequantizes fp8.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open

from eaglenest.common.io import atomic_path, sha256_file

if TYPE_CHECKING:
    from eaglenest.settings.hidden_states import HiddenSettings

FORMAT = "eaglenest-hidden/1"


# safetensors dtype name, torch dtype, bytes per element
_ST_DTYPES = {
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "U8": (torch.uint8, 1),
}


FP8_MAX = 448.0  # largest finite float8_e4m3fn
TOPK_CHUNK_ROWS = 2048  # rows of logits computed at once for top-k, by every capture


def tensor_specs(
    n_samples: int, n_tokens: int, hidden_size: int, n_aux: int, settings: HiddenSettings
) -> list[tuple[str, str, list[int]]]:
    """(name, safetensors dtype, shape) of every tensor of a shard file, in file order."""
    stored = {"bf16": "BF16", "fp8": "F8_E4M3", "fp32": "F32"}[settings.dtype]
    specs = [("aux", stored, [n_tokens, n_aux * hidden_size])]
    if settings.dtype == "fp8":
        specs.append(("aux_scale", "F32", [n_tokens, n_aux]))
    if settings.target_signal == "topk":
        specs += [
            ("topk_ids", "I32", [n_tokens, settings.top_k]),
            ("topk_values", "F32", [n_tokens, settings.top_k]),
        ]
    else:
        specs.append(("final_hidden", stored, [n_tokens, hidden_size]))
        if settings.dtype == "fp8":
            specs.append(("final_hidden_scale", "F32", [n_tokens]))
    specs += [
        ("input_ids", "I64", [n_tokens]),
        ("loss_mask", "U8", [n_tokens]),
        ("offsets", "I64", [n_samples + 1]),
    ]
    return specs


def bytes_per_token(specs) -> int:
    """Bytes a shard of these specs takes per token (the per-sample offsets aside)."""
    return sum(
        int(np.prod(shape[1:], dtype=np.int64)) * _ST_DTYPES[dtype][1]
        for name, dtype, shape in specs
        if name != "offsets"
    )


def safetensors_header(
    specs: list[tuple[str, str, list[int]]], metadata: dict[str, str]
) -> tuple[bytes, dict[str, int]]:
    """The header bytes (8-byte length + JSON padded to 8 bytes) and each tensor's file offset."""
    header: dict[str, Any] = {"__metadata__": metadata}
    begin = 0
    for name, dtype, shape in specs:
        size = int(np.prod(shape, dtype=np.int64)) * _ST_DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + size]}
        begin += size
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)
    data_start = 8 + len(text)
    positions = {name: data_start + header[name]["data_offsets"][0] for name, _, _ in specs}
    positions["__end__"] = data_start + begin
    return struct.pack("<Q", len(text)) + text, positions


def fp8_quantize(x: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, blocks*H] -> float8_e4m3fn values and float32 scales [T, blocks] (amax / 448)."""
    rows = x.float().reshape(x.shape[0], blocks, -1)
    scale = rows.abs().amax(dim=-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (rows / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape[0], -1), scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    blocks = scale.shape[-1] if scale.dim() == 2 else 1
    rows = q.float().reshape(q.shape[0], blocks, -1)
    return (rows * scale.reshape(q.shape[0], blocks, 1)).reshape(q.shape[0], -1)


def _as_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn):
        t = t.view(torch.uint8)
    return t.numpy().tobytes()


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """`os.pwrite` until every byte is written: one call may write less (Linux stops at
    0x7ffff000 bytes, ~2 GiB, and one 32K-token sample of fp32 aux at H=7168 is 2.8 GB)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:  # no progress: a retry would loop forever
            raise OSError(f"pwrite wrote {written} bytes at offset {offset} ({len(view)} left)")
        view, offset = view[written:], offset + written


class ShardWriter:
    """Positioned writes of one sample's rows into the laid-out file."""

    def __init__(
        self, fd: int, specs, positions: dict[str, int], settings: HiddenSettings, n_aux: int = 3
    ):
        self.fd = fd
        self.positions = positions
        self.row_bytes = {
            name: int(np.prod(shape[1:], dtype=np.int64)) * _ST_DTYPES[dtype][1]
            for name, dtype, shape in specs
        }
        self.stored = {name: dtype for name, dtype, _ in specs}
        self.rows = {name: shape[0] for name, _, shape in specs}
        self.settings = settings
        self.n_aux = n_aux

    def write(self, name: str, first_row: int, values: torch.Tensor) -> None:
        """Rows `first_row:` of tensor `name`; refused unless they lie inside it and have its row
        size: a positioned write past them would overwrite the next tensor silently."""
        data = _as_bytes(values)
        row_bytes = self.row_bytes[name]
        n_rows = len(data) // row_bytes if row_bytes else 0
        if len(data) != n_rows * row_bytes or not 0 <= first_row <= self.rows[name] - n_rows:
            raise ValueError(
                f"{name}: rows {first_row}:{first_row + n_rows} of {len(data)} bytes do not fit "
                f"its {self.rows[name]} rows of {row_bytes} bytes (values {list(values.shape)})"
            )
        pwrite_all(self.fd, data, self.positions[name] + first_row * row_bytes)

    def write_sample(
        self,
        first_row: int,
        aux: torch.Tensor,
        signal: dict[str, torch.Tensor],
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
    ) -> None:
        """One sample's rows: aux [n, n_aux * H], the target signal (`final_hidden` [n, H] or
        `topk_ids` and `topk_values` [n, k]), input_ids [n] and loss_mask [n] (uint8), in the
        storage dtype (`stored_rows`)."""
        rows = stored_rows(aux, signal, input_ids, loss_mask, self.settings.dtype, self.n_aux)
        for name, values in rows.items():
            self.write(name, first_row, values)


def stored_rows(
    aux: torch.Tensor,
    signal: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    dtype: str,
    n_aux: int = 3,
) -> dict[str, torch.Tensor]:
    """A sample's tensors exactly as a shard file holds them (aux and final_hidden in the storage
    dtype `dtype`, with their scales for fp8), by tensor name. The one packing of both the files
    (ShardWriter) and the states training asks of the capture servers (hidden.store none)."""
    rows: dict[str, torch.Tensor] = {}

    def states(name: str, values: torch.Tensor, blocks: int) -> None:
        if dtype == "fp8":
            q, scale = fp8_quantize(values, blocks)
            rows[name], rows[f"{name}_scale"] = q, scale if blocks > 1 else scale[:, 0]
        else:
            rows[name] = values.to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])

    states("aux", aux, n_aux)
    if "final_hidden" in signal:
        states("final_hidden", signal["final_hidden"], 1)
    else:
        rows["topk_ids"] = signal["topk_ids"].to(torch.int32)
        rows["topk_values"] = signal["topk_values"].to(torch.float32)
    rows["input_ids"] = input_ids.to(torch.int64)
    rows["loss_mask"] = loss_mask.to(torch.uint8)
    return rows


def loaded_rows(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `HiddenShard.sample` gives for a sample's stored tensors: aux and final_hidden
    dequantized when fp8 (else in their storage dtype), the rest as stored."""
    result = {}
    for name, values in stored.items():
        if name.endswith("_scale"):
            continue
        scale = stored.get(f"{name}_scale")
        result[name] = values if scale is None else fp8_dequantize(values, scale)
    return result


@contextlib.contextmanager
def create_hidden_shard(
    out: str | Path, specs, metadata: dict[str, str], settings: HiddenSettings, n_aux: int
) -> Iterator[ShardWriter]:
    """Lay out a shard file (header and zeroed tensors) at a temporary path beside `out`, yield
    its writer, then sync it, check that it reads and rename it to `out`: a killed job leaves
    nothing that passes as complete."""
    header, positions = safetensors_header(specs, metadata)
    with atomic_path(out) as tmp, open(tmp, "r+b") as f:
        f.truncate(positions["__end__"])
        fd = f.fileno()
        pwrite_all(fd, header, 0)
        yield ShardWriter(fd, specs, positions, settings, n_aux)
        f.flush()
        os.fsync(fd)
        check_readable(tmp)


def check_readable(path: str | Path) -> None:
    """The file opens with safetensors and every tensor is where its header says."""
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            f.get_slice(name).get_shape()


# --- reading ------------------------------------------------------------------------------


class HiddenShard:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._file = safe_open(str(self.path), framework="pt")
        except Exception as error:  # SafetensorError, OSError: the path is wanted in either
            raise ValueError(
                f"{self.path}: not a readable safetensors file ({error}); a hidden-state "
                f"shard half written or copied? Delete it and rerun its capture"
            ) from error
        self.metadata: dict[str, str] = self._file.metadata() or {}
        if self.metadata.get("format") != FORMAT:
            raise ValueError(
                f"{self.path}: field format: expected {FORMAT!r}, found "
                f"{self.metadata.get('format')!r} (not a hidden-state shard)"
            )
        self.offsets = self._file.get_tensor("offsets")
        self.names = set(self._file.keys())
        self.aux_layer_ids: list[int] = json.loads(self.metadata["aux_layer_ids"])
        self.hidden_size = int(self.metadata["hidden_size"])
        self.dtype = self.metadata["dtype"]
        self.target_signal = self.metadata["target_signal"]
        self.check_offsets()

    def check_offsets(self) -> None:
        """offsets start at 0, never decrease, end at every row tensor's row count, and number
        one more than the sample ids: else `sample(i)` would read another sample's rows."""
        offsets = self.offsets
        problem = None
        if offsets.dim() != 1 or len(offsets) < 1 or int(offsets[0]) != 0:
            problem = "do not start at 0"
        elif bool((offsets[1:] < offsets[:-1]).any()):
            problem = "decrease"
        elif "sample_ids" in self.metadata and len(self.sample_ids) != len(offsets) - 1:
            problem = f"count {len(offsets) - 1} samples, the metadata {len(self.sample_ids)} ids"
        else:
            for name in sorted(self.names - {"offsets"}):
                rows = self._file.get_slice(name).get_shape()[0]
                if rows != int(offsets[-1]):
                    problem = f"end at {int(offsets[-1])}, but {name} has {rows} rows"
                    break
        if problem:
            raise ValueError(f"{self.path}: field offsets: {problem}")

    @property
    def sample_ids(self) -> list[str]:
        return json.loads(self.metadata["sample_ids"])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _rows(self, name: str, begin: int, end: int) -> torch.Tensor:
        return self._file.get_slice(name)[begin:end]

    def _bounds(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: sample {i} out of range [0, {len(self)})")
        return int(self.offsets[i]), int(self.offsets[i + 1])

    def sample(self, i: int, spans: list[tuple[int, int]] | None = None) -> dict[str, torch.Tensor]:
        """Sample i's rows; `spans` (ranges within the sample): only those rows, in order, the
        others never read (a window of a long answer reads its own rows only)."""
        begin, end = self._bounds(i)
        names = sorted(self.names - {"offsets"})
        if spans is None:
            rows = loaded_rows({n: self._rows(n, begin, end) for n in names})
        else:
            rows = loaded_rows(
                {
                    n: torch.cat([self._rows(n, begin + a, begin + b) for a, b in spans])
                    for n in names
                }
            )
        self.check_finite(i, rows)
        return rows

    def check_finite(self, i: int, rows: dict[str, torch.Tensor]) -> None:
        """A stored NaN or inf (a capture that overflowed in fp16, a damaged file) was read
        without complaint and trained on: refused naming the shard, the sample and the tensor."""
        for name, values in rows.items():
            if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                sample = self.sample_ids[i] if "sample_ids" in self.metadata else i
                raise ValueError(
                    f"{self.path}: sample {i} ({sample}): {name} holds NaN or infinite values; "
                    "delete the shard and rerun its capture (in bf16 or fp32 if it was fp16)"
                )

    def prompt_len(self, i: int) -> int:
        """Sample i's prompt tokens: where its loss mask (the answer's tokens) starts."""
        begin, end = self._bounds(i)
        answer = self._rows("loss_mask", begin, end).nonzero()
        return int(answer[0, 0]) if len(answer) else end - begin

    def check(self, field: str, expected: Any, found: Any) -> None:
        if expected is not None and expected != found:
            raise ValueError(f"{self.path}: field {field}: expected {expected!r}, found {found!r}")


def open_hidden_shard(
    path: str | Path,
    expect_layer_ids: list[int] | tuple[int, ...] | None = None,
    expect_hidden_size: int | None = None,
    expect_tokens: str | Path | None = None,
) -> HiddenShard:
    """Open a shard, checking what the caller knows: layer ids, hidden size, and the tokens
    shard it was computed from (`tokens_sha256` of its metadata)."""
    shard = HiddenShard(path)
    if expect_layer_ids is not None:
        shard.check("aux_layer_ids", list(expect_layer_ids), shard.aux_layer_ids)
    shard.check("hidden_size", expect_hidden_size, shard.hidden_size)
    if expect_tokens is not None:
        shard.check(
            "tokens_sha256", sha256_file(expect_tokens), shard.metadata.get("tokens_sha256")
        )
    return shard
