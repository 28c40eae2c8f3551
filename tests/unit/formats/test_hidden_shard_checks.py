"""Rows stay inside their tensors, offsets agree with shapes, and a hidden shard names the tokens
it was made from; a vLLM state file with fewer rows than its tokens is refused."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch


def small_shard(tmp_path: Path, offsets: list[int], n_tokens: int = 5) -> Path:
    from eaglenest.common.config import settings_from_sections
    from eaglenest.common.io import sha256_file
    from eaglenest.formats.hidden_shard import FORMAT, create_hidden_shard, tensor_specs
    from eaglenest.settings.hidden_states import HiddenSettings

    settings = settings_from_sections(HiddenSettings, hidden={"dtype": "fp32"})
    tokens = tmp_path / "tokens.parquet"
    pl.DataFrame({"id": ["a", "b"]}).write_parquet(tokens)
    specs = tensor_specs(len(offsets) - 1, n_tokens, 4, 3, settings)
    metadata = {
        "format": FORMAT,
        "aux_layer_ids": "[1, 2, 3]",
        "hidden_size": "4",
        "dtype": "fp32",
        "target_signal": "final_hidden",
        "sample_ids": json.dumps([f"s{i}" for i in range(len(offsets) - 1)]),
        "tokens_sha256": sha256_file(tokens),
    }
    out = tmp_path / f"h{'_'.join(map(str, offsets))}.safetensors"
    with create_hidden_shard(out, specs, metadata, settings, 3) as writer:
        writer.write("offsets", 0, torch.tensor(offsets, dtype=torch.int64))
        with pytest.raises(ValueError, match=r"input_ids: rows 4:7 .* do not fit its 5 rows"):
            writer.write("input_ids", 4, torch.zeros(3, dtype=torch.int64))
    return out


def test_shard_rows_offsets_and_tokens_are_checked(tmp_path):
    from eaglenest.capture.request import VllmCaptureError
    from eaglenest.formats.hidden_shard import open_hidden_shard
    from eaglenest.stages.hidden_states.vllm_backend import pack_request

    good = small_shard(tmp_path, [0, 2, 5])
    assert len(open_hidden_shard(good, expect_tokens=tmp_path / "tokens.parquet")) == 2
    other_tokens = tmp_path / "other.parquet"
    pl.DataFrame({"id": ["c"]}).write_parquet(other_tokens)
    with pytest.raises(ValueError, match="tokens_sha256"):
        open_hidden_shard(good, expect_tokens=other_tokens)
    with pytest.raises(ValueError, match=r"field offsets: end at 7, but \w+ has 5 rows"):
        open_hidden_shard(small_shard(tmp_path, [0, 2, 7]))
    with pytest.raises(ValueError, match="field offsets: decrease"):
        open_hidden_shard(small_shard(tmp_path, [0, 4, 3, 5]))

    # vLLM's state file with fewer rows than the tokens it names.
    frame = pl.DataFrame({"id": ["s0"], "input_ids": [[5, 6, 7]], "prompt_len": [1]})
    states = {"token_ids": torch.tensor([5, 6, 7]), "hidden_states": torch.zeros(2, 4, 4)}
    with pytest.raises(VllmCaptureError, match="2 rows for 3 tokens"):
        pack_request(None, frame, 0, [0, 3], states, None, Path("tokens/00000.parquet"))


def test_a_stored_shard_with_non_finite_values_is_refused_naming_the_sample(tmp_path):
    """A shard of NaN was read without complaint and trained on."""
    from eaglenest.formats.hidden_shard import open_hidden_shard

    path = small_shard(tmp_path, [0, 2, 5])
    shard = open_hidden_shard(path)
    assert all(v.isfinite().all() for v in shard.sample(1).values() if v.is_floating_point())
    name = next(n for n in sorted(shard.names) if n in ("aux", "aux_hidden_states", "final_hidden"))
    raw = bytearray(path.read_bytes())
    # The first value of `name` made NaN in place: the header says where its bytes lie.
    header_len = int.from_bytes(raw[:8], "little")
    start = 8 + header_len + json.loads(raw[8 : 8 + header_len])[name]["data_offsets"][0]
    raw[start : start + 4] = torch.tensor([float("nan")], dtype=torch.float32).numpy().tobytes()
    path.write_bytes(bytes(raw))
    shard = open_hidden_shard(path)
    shard.sample(1)  # sample 1's rows are finite
    with pytest.raises(ValueError, match=rf"{path}: sample 0 \(s0\): {name} holds NaN"):
        shard.sample(0)
    with pytest.raises(ValueError, match="holds NaN"):
        shard.sample(0, spans=[(0, 1)])
