"""Reading hidden-state shards (see hidden_states.py): memory-mapped, one sample at a time.

`open_hidden_shard` checks the file's metadata against what the caller expects (layer ids,
hidden size) and raises a ValueError naming the file, the field, the expected and the found value.
`sample(i)` reads only rows offsets[i]:offsets[i+1] (safetensors `get_slice`) and dequantizes fp8.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eaglenest.hidden_states import FORMAT, fp8_dequantize


class HiddenShard:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = safe_open(str(self.path), framework="pt")
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

    @property
    def sample_ids(self) -> list[str]:
        return json.loads(self.metadata["sample_ids"])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _rows(self, name: str, begin: int, end: int) -> torch.Tensor:
        return self._file.get_slice(name)[begin:end]

    def _states(self, name: str, begin: int, end: int) -> torch.Tensor:
        values = self._rows(name, begin, end)
        scale_name = f"{name}_scale"
        if scale_name in self.names:
            return fp8_dequantize(values, self._rows(scale_name, begin, end))
        return values

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: sample {i} out of range [0, {len(self)})")
        begin, end = int(self.offsets[i]), int(self.offsets[i + 1])
        result = {
            "aux": self._states("aux", begin, end),
            "input_ids": self._rows("input_ids", begin, end),
            "loss_mask": self._rows("loss_mask", begin, end),
        }
        if self.target_signal == "topk":
            result["topk_ids"] = self._rows("topk_ids", begin, end)
            result["topk_values"] = self._rows("topk_values", begin, end)
        else:
            result["final_hidden"] = self._states("final_hidden", begin, end)
        return result

    def check(self, field: str, expected: Any, found: Any) -> None:
        if expected is not None and expected != found:
            raise ValueError(f"{self.path}: field {field}: expected {expected!r}, found {found!r}")


def open_hidden_shard(
    path: str | Path,
    expect_layer_ids: list[int] | tuple[int, ...] | None = None,
    expect_hidden_size: int | None = None,
) -> HiddenShard:
    shard = HiddenShard(path)
    if expect_layer_ids is not None:
        shard.check("aux_layer_ids", list(expect_layer_ids), shard.aux_layer_ids)
    shard.check("hidden_size", expect_hidden_size, shard.hidden_size)
    return shard
