"""Training from the capture servers (hidden.store none) reads exactly what training from files
reads: one capture answer (a state file as our connector writes it: `hidden_states` [T, 4, H] and
`token_ids`) packed by the pool path (capture/reader.stored_answer, then loaded_rows) equals,
tensor for tensor and dtype for dtype, the same answer packed into a real hidden-state file by
the capture stage (vllm_backend.pack_request) and read back with HiddenShard.sample, for every
storage dtype (fp8's rounding and scales included) and both target signals."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import save_file

H, K = 8, 4
LENGTHS = (5, 3)


def target_signal(kind: str):
    """A stand-in for FinalSignal (which needs a checkpoint): the same callable shape, and
    deterministic, so both paths get the same signal from the same layer-N rows."""
    head = torch.randn(16, H, generator=torch.Generator().manual_seed(1))

    def signal(last_layer: torch.Tensor) -> dict[str, torch.Tensor]:
        if kind == "final_hidden":
            return {"final_hidden": last_layer * 0.5}
        top = torch.topk(last_layer.float() @ head.T, K)
        return {"topk_ids": top.indices.to(torch.int32), "topk_values": top.values}

    return signal


def answers(directory: Path, frame: pl.DataFrame) -> list[str]:
    """One state file per sample, as the connector writes them (values spanning magnitudes, so
    fp8's per-row scales matter)."""
    paths = []
    generator = torch.Generator().manual_seed(0)
    for i, ids in enumerate(frame["input_ids"].to_list()):
        states = torch.randn(len(ids), 4, H, generator=generator) * torch.logspace(-3, 2, H)
        path = directory / f"cmpl-eaglenest-test-{i}"
        save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(path))
        paths.append(str(path))
    return paths


def file_samples(tmp_path: Path, frame, tokens: Path, signal, dtype: str, kind: str) -> list:
    from eaglenest.capture.state_file import read_request_file
    from eaglenest.common.config import settings_from_sections
    from eaglenest.formats.hidden_shard import (
        FORMAT,
        create_hidden_shard,
        open_hidden_shard,
        tensor_specs,
    )
    from eaglenest.settings.hidden_states import HiddenSettings
    from eaglenest.stages.hidden_states.vllm_backend import pack_request

    hidden = {"dtype": dtype, "target_signal": kind, "top_k": K}
    settings = settings_from_sections(HiddenSettings, hidden=hidden)
    offsets = torch.tensor([0, LENGTHS[0], sum(LENGTHS)])
    specs = tensor_specs(len(LENGTHS), sum(LENGTHS), H, 3, settings)
    metadata = {"format": FORMAT, "aux_layer_ids": "[1, 2, 3]", "hidden_size": str(H),
                "dtype": dtype, "target_signal": kind,
                "sample_ids": json.dumps(frame["id"].to_list())}  # fmt: skip
    out = tmp_path / f"{dtype}-{kind}.safetensors"
    with create_hidden_shard(out, specs, metadata, settings, 3) as writer:
        writer.write("offsets", 0, offsets)
        for i, path in enumerate(answers(tmp_path / "files", frame)):
            pack_request(writer, frame, i, offsets, read_request_file(path), signal, tokens)
    shard = open_hidden_shard(out)
    return [shard.sample(i) for i in range(len(shard))]


@pytest.mark.parametrize("kind", ["final_hidden", "topk"])
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_a_capture_answer_packs_as_the_hidden_state_file_holds_it(tmp_path, dtype, kind):
    from eaglenest.capture.reader import stored_answer
    from eaglenest.formats.hidden_shard import loaded_rows

    frame = pl.DataFrame({
        "id": ["a", "b"],
        "input_ids": [[3, 1, 4, 1, 5], [9, 2, 6]],
        "prompt_len": [2, 1],
    })  # fmt: skip
    tokens = tmp_path / "tokens.parquet"
    frame.write_parquet(tokens)
    (tmp_path / "files").mkdir()
    (tmp_path / "pool").mkdir()
    signal = target_signal(kind)
    from_files = file_samples(tmp_path, frame, tokens, signal, dtype, kind)
    paths = answers(tmp_path / "pool", frame)
    # As a pooled shard's sample(i) reads it: held as stored (PooledStates._pack), then loaded.
    from_pool = [
        loaded_rows(stored_answer(frame, i, p, signal, dtype, 3, tokens))
        for i, p in enumerate(paths)
    ]
    for a, b in zip(from_pool, from_files, strict=True):
        assert sorted(a) == sorted(b)
        for name in b:
            assert a[name].dtype == b[name].dtype, name
            assert torch.equal(a[name], b[name]), name
    assert not list((tmp_path / "pool").iterdir()), "the answers' state files were not deleted"
    # The two agree because they round alike, not because nothing was rounded.
    generator = torch.Generator().manual_seed(0)  # answers()' first sample, unrounded
    raw = torch.randn(LENGTHS[0], 4, H, generator=generator) * torch.logspace(-3, 2, H)
    raw_aux = raw[:, :3, :].reshape(LENGTHS[0], -1)
    assert torch.equal(from_pool[0]["aux"].float(), raw_aux) == (dtype == "fp32")
    torch.testing.assert_close(from_pool[0]["aux"].float(), raw_aux, rtol=0.07, atol=1e-3)


def test_an_answer_of_more_than_three_layers_packs_them_all_and_the_last_as_the_signal():
    """A capture of five aux layers (train.families' union) answers [T, 6, H]: aux is the first
    five side by side [T, 5H], the target signal comes of layer N, the last (it took layers 0-2
    and layer 3: a wider capture packed no row)."""
    from eaglenest.capture.answer import request_rows

    frame = pl.DataFrame({"id": ["a"], "input_ids": [[3, 1, 4]], "prompt_len": [1]})
    hidden = torch.randn(3, 6, H, generator=torch.Generator().manual_seed(2))
    states = {"hidden_states": hidden, "token_ids": torch.tensor([3, 1, 4])}
    aux, signal, ids, _ = request_rows(frame, 0, states, target_signal("final_hidden"), Path("t"))
    assert torch.equal(aux, torch.cat([hidden[:, k] for k in range(5)], dim=-1))
    assert torch.equal(signal["final_hidden"], hidden[:, 5] * 0.5) and ids.tolist() == [3, 1, 4]
