"""The hidden-states stage: exact target features, packed per shard, streamed to disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from safetensors import safe_open

from eaglenest.common.batching import (
    pack_batches,
    pack_rows,
    pack_width,
    packed_batches,
    packed_rows,
    pooled_batches,
)
from eaglenest.common.config import settings_from_sections
from eaglenest.formats.hidden_shard import (
    ShardWriter,
    open_hidden_shard,
    pwrite_all,
)
from eaglenest.formats.target_head import save_target_head
from eaglenest.formats.tokens import loss_mask
from eaglenest.settings.hidden_states import HiddenSettings, TargetHeadSettings
from eaglenest.stages.hidden_states.extract import extract_hidden_states
from eaglenest.target_model.loading import default_aux_layer_ids, load_target

torch.set_num_threads(1)


def write_tokens(path: Path, n_samples: int, seed: int = 0, vocab: int = 500) -> Path:
    """A tokens shard of random ids with varied lengths (the target's vocabulary is 512)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_samples):
        n = int(rng.integers(5, 40))
        prompt_len = int(rng.integers(1, n))
        rows.append(
            {
                "id": f"{i:016x}",
                "input_ids": rng.integers(0, vocab, n).tolist(),
                "prompt_len": prompt_len,
                "n_tokens": n,
                "token_source": "server",
                "truncated": False,
                "rebuild_agrees": None,
            }
        )
    pl.DataFrame(rows, schema_overrides={"input_ids": pl.List(pl.Int64)}).write_parquet(path)
    return path


@pytest.fixture(scope="module")
def target(demo_target_dir):
    return load_target(demo_target_dir, device="cpu", model_dtype="float32")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    return write_tokens(tmp_path_factory.mktemp("tokens") / "00000.parquet", 9)


def run(tokens, demo_target_dir, target, out, **settings):
    settings = settings_from_sections(
        HiddenSettings,
        hidden={"device": "cpu", "model_dtype": "float32", **settings},
        target={"model": "demo", "path": str(demo_target_dir)},
    )
    return extract_hidden_states(
        tokens=tokens,
        out=out,
        settings=settings,
        summary_out=Path(out).with_suffix(".json"),
        model=target,
    )


@torch.inference_mode()
def reference(target, ids: list[int]):
    """One sample alone, with every hidden state: what the stage must reproduce."""
    out = target(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states, out.logits[0]


def test_final_hidden_state_is_normed_last_entry(target):
    """transformers applies the final norm to the last entry of hidden_states."""
    with torch.inference_mode():
        ids = torch.tensor([[1, 2, 3, 4]])
        out = target(ids, output_hidden_states=True)
        assert len(out.hidden_states) == target.config.num_hidden_layers + 1
        torch.testing.assert_close(out.hidden_states[-1], target.model(ids).last_hidden_state)


def test_aux_and_final_equal_unbatched_reference(tokens, demo_target_dir, target, tmp_path):
    # A small budget forces several batches with padding.
    summary = run(tokens, demo_target_dir, target, tmp_path / "h.safetensors", dtype="fp32",
                  max_batch_tokens=80)  # fmt: skip
    frame = pl.read_parquet(tokens)
    layer_ids = default_aux_layer_ids(target.config.num_hidden_layers)
    assert layer_ids == (2, 4, 5)
    shard = open_hidden_shard(tmp_path / "h.safetensors", layer_ids, 64)
    assert len(shard) == len(frame) and shard.sample_ids == frame["id"].to_list()
    assert summary["tokens"] == frame["n_tokens"].sum()
    for i, row in enumerate(frame.iter_rows(named=True)):
        states, _ = reference(target, row["input_ids"])
        got = shard.sample(i)
        want_aux = torch.cat([states[k][0] for k in layer_ids], dim=-1)
        torch.testing.assert_close(got["aux"], want_aux, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got["final_hidden"], states[-1][0], atol=1e-5, rtol=1e-4)
        assert got["input_ids"].tolist() == row["input_ids"]
        want_mask = loss_mask(row["prompt_len"], row["n_tokens"]).tolist()
        assert got["loss_mask"].tolist() == want_mask


def test_batched_equals_one_at_a_time(tokens, demo_target_dir, target, tmp_path):
    run(tokens, demo_target_dir, target, tmp_path / "a.safetensors", dtype="fp32")
    run(tokens, demo_target_dir, target, tmp_path / "b.safetensors", dtype="fp32",
        max_batch_tokens=1)  # fmt: skip
    a, b = (
        open_hidden_shard(tmp_path / "a.safetensors"),
        open_hidden_shard(tmp_path / "b.safetensors"),
    )
    for i in range(len(a)):
        for name, value in a.sample(i).items():
            torch.testing.assert_close(value, b.sample(i)[name], atol=1e-5, rtol=1e-4)


def short_pwrites(monkeypatch, max_bytes: int) -> list[int]:
    """Make every os.pwrite write at most `max_bytes` (as Linux does past 0x7ffff000 bytes);
    return the list of byte counts written, one per call."""
    real_pwrite, calls = os.pwrite, []

    def pwrite(fd: int, data, offset: int) -> int:
        written = real_pwrite(fd, memoryview(data)[:max_bytes], offset)
        calls.append(written)
        return written

    monkeypatch.setattr(os, "pwrite", pwrite)
    return calls


def test_short_pwrites_are_continued_until_every_byte_is_written(tmp_path, monkeypatch):
    data = np.random.default_rng(0).integers(0, 256, size=10_000, dtype=np.uint8).tobytes()
    path = tmp_path / "out.bin"
    path.write_bytes(b"\0" * 20_000)
    calls = short_pwrites(monkeypatch, 999)
    with open(path, "r+b") as f:
        pwrite_all(f.fileno(), data, 5_000)
    assert len(calls) == 11 and sum(calls) == len(data)
    assert path.read_bytes() == b"\0" * 5_000 + data + b"\0" * 5_000


def test_shard_writer_rows_survive_short_writes(tmp_path, monkeypatch):
    values = torch.randn(6, 5, dtype=torch.float32)  # 120 bytes, written 7 bytes a call
    specs = [("header", "I64", [2]), ("aux", "F32", [10, 5])]
    positions = {"header": 0, "aux": 16}
    path = tmp_path / "shard.bin"
    path.write_bytes(b"\0" * (16 + 10 * 5 * 4))
    calls = short_pwrites(monkeypatch, 7)
    with open(path, "r+b") as f:
        writer = ShardWriter(f.fileno(), specs, positions, settings_from_sections(HiddenSettings))
        writer.write("aux", 3, values)
    assert len(calls) == -(-values.numel() * 4 // 7)
    stored = np.frombuffer(path.read_bytes()[16:], dtype=np.float32).reshape(10, 5)
    assert np.array_equal(stored[3:9], values.numpy())
    assert not stored[:3].any() and not stored[9:].any()


def test_a_pwrite_that_makes_no_progress_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    with open(tmp_path / "x", "wb") as f, pytest.raises(OSError, match="wrote 0 bytes"):
        pwrite_all(f.fileno(), b"abc", 0)


def test_pack_batches_respects_padded_budget():
    lengths = [5, 30, 12, 12, 7, 30, 1]
    batches = pack_batches(lengths, 60)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 60


def test_pooled_batches_draw_new_batches_under_the_budget():
    lengths = np.random.default_rng(0).integers(1, 100, size=200)
    draws = [pooled_batches(lengths, 256, 4, np.random.default_rng(seed)) for seed in (0, 1, 0)]
    for batches in draws:
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for batch in batches:
            assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 256
    compositions = [{frozenset(b) for b in batches} for batches in draws]
    assert compositions[0] == compositions[2]  # the same draw: the same batches (resumption)
    assert len(compositions[0] & compositions[1]) < len(compositions[0]) // 4  # new ones
    # One pool over everything: the length-sorted batches of pack_batches (ties aside).
    whole = pooled_batches(lengths, 256, 10_000, np.random.default_rng(0))

    def shapes(batches):
        return sorted(tuple(sorted(int(lengths[i]) for i in b)) for b in batches)

    assert shapes(whole) == shapes(pack_batches(lengths, 256))
    # Smaller pools mix lengths more: more padding, hence more batches.
    assert len(pooled_batches(lengths, 256, 1, np.random.default_rng(0))) > len(whole)


def test_topk_matches_logits(tokens, demo_target_dir, target, tmp_path, monkeypatch):
    import eaglenest.stages.hidden_states.extract as hs

    monkeypatch.setattr(hs, "TOPK_CHUNK_ROWS", 7)  # logits in chunks that cut across samples
    run(tokens, demo_target_dir, target, tmp_path / "t.safetensors", target_signal="topk",
        top_k=8, max_batch_tokens=100)  # fmt: skip
    shard = open_hidden_shard(tmp_path / "t.safetensors")
    frame = pl.read_parquet(tokens)
    for i, row in enumerate(frame.iter_rows(named=True)):
        _, logits = reference(target, row["input_ids"])
        values, ids = torch.topk(logits.float(), 8, dim=-1)
        got = shard.sample(i)
        assert got["topk_ids"].dtype == torch.int32
        torch.testing.assert_close(got["topk_values"], values, atol=1e-4, rtol=1e-4)
        # ids agree except where two logits tie within rounding
        same = (got["topk_ids"] == ids).float().mean()
        assert same > 0.99
        assert "final_hidden" not in got


def test_bf16_and_fp8_storage(tokens, demo_target_dir, target, tmp_path):
    exact = run(tokens, demo_target_dir, target, tmp_path / "f.safetensors", dtype="fp32")
    bf16 = run(tokens, demo_target_dir, target, tmp_path / "b.safetensors", dtype="bf16")
    fp8 = run(tokens, demo_target_dir, target, tmp_path / "q.safetensors", dtype="fp8")
    h = 64
    # bytes per token as reported = file size / tokens; the payload is what the format says
    for summary, payload in ((bf16, 2 * 4 * h + 9), (fp8, 4 * h + 3 * 4 + 4 + 9)):
        assert summary["bytes_per_token"] == pytest.approx(summary["bytes"] / summary["tokens"])
        assert payload <= summary["bytes_per_token"] < payload + 200  # + header and offsets
    assert (
        json.loads((tmp_path / "q.json").read_text())["bytes_per_token"] == fp8["bytes_per_token"]
    )
    ref = open_hidden_shard(tmp_path / "f.safetensors")
    for name, path, bound in (("bf16", "b", 2**-8), ("fp8", "q", 2**-3)):
        shard = open_hidden_shard(tmp_path / f"{path}.safetensors")
        assert shard.dtype == name
        for i in range(len(ref)):
            for key in ("aux", "final_hidden"):
                want, got = ref.sample(i)[key], shard.sample(i)[key].float()
                # relative to each layer block's largest value (the fp8 scale's unit)
                blocks = 3 if key == "aux" else 1
                amax = want.reshape(len(want), blocks, -1).abs().amax(-1, keepdim=True)
                err = (got - want).reshape(len(want), blocks, -1).abs() / amax
                assert err.max() <= bound, (name, key, float(err.max()))
    assert exact["bytes_per_token"] > bf16["bytes_per_token"] > fp8["bytes_per_token"]


def test_reader_names_mismatches(tokens, demo_target_dir, target, tmp_path):
    path = tmp_path / "h.safetensors"
    run(tokens, demo_target_dir, target, path, aux_layer_ids=[1, 3, 6])
    assert open_hidden_shard(path, [1, 3, 6], 64).aux_layer_ids == [1, 3, 6]
    with pytest.raises(
        ValueError, match=r"h\.safetensors.*aux_layer_ids.*\[2, 4, 5\].*\[1, 3, 6\]"
    ):
        open_hidden_shard(path, expect_layer_ids=[2, 4, 5])
    with pytest.raises(ValueError, match=r"h\.safetensors.*hidden_size.*128.*64"):
        open_hidden_shard(path, expect_hidden_size=128)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        run(tokens, demo_target_dir, target, tmp_path / "x.safetensors", aux_layer_ids=[1, 3, 8])


def test_metadata(tokens, demo_target_dir, target, tmp_path):
    import hashlib

    path = tmp_path / "h.safetensors"
    run(tokens, demo_target_dir, target, path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert f.get_slice("aux").get_dtype() == "BF16"
    assert meta["tokens_sha256"] == hashlib.sha256(tokens.read_bytes()).hexdigest()
    config_hash = hashlib.sha256((demo_target_dir / "config.json").read_bytes()).hexdigest()
    assert meta["target_config_sha256"] == config_hash
    assert json.loads(meta["aux_layer_ids"]) == [2, 4, 5] and meta["hidden_size"] == "64"
    assert set(json.loads(meta["versions"])) == {"torch", "transformers", "eaglenest"}


def test_killed_write_leaves_nothing_and_rerun_is_identical(
    tokens, demo_target_dir, target, tmp_path, monkeypatch
):
    import eaglenest.stages.hidden_states.extract as hs

    out = tmp_path / "h.safetensors"
    real_forward, calls = hs.forward_batch, []

    def dying_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(hs, "forward_batch", dying_forward)
    with pytest.raises(KeyboardInterrupt):
        run(tokens, demo_target_dir, target, out, max_batch_tokens=60)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(hs, "forward_batch", real_forward)
    run(tokens, demo_target_dir, target, out, max_batch_tokens=60)
    first = out.read_bytes()
    run(tokens, demo_target_dir, target, out, max_batch_tokens=60)
    assert out.read_bytes() == first


def test_target_head(demo_target_dir, target, tmp_path):
    """Read from the checkpoint (tests/unit/target_model/test_target_files.py compares it byte for byte)."""
    out = tmp_path / "target_head.safetensors"
    save_target_head(
        out, settings_from_sections(TargetHeadSettings, target={"path": str(demo_target_dir)})
    )
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
        torch.testing.assert_close(
            f.get_tensor("embed_tokens.weight"), target.model.embed_tokens.weight
        )
        torch.testing.assert_close(f.get_tensor("norm.weight"), target.model.norm.weight)
        assert ("lm_head.weight" in set(f.keys())) != json.loads(meta["tied_word_embeddings"])
    assert json.loads(meta["aux_layer_ids"]) == [2, 4, 5] and meta["hidden_size"] == "64"
    assert meta["source"] == "checkpoint"


MEMORY_PROBE = textwrap.dedent(
    """
    import resource, sys, torch
    torch.set_num_threads(1)
    from eaglenest.common.config import settings_from_sections
    from eaglenest.settings.hidden_states import HiddenSettings
    from eaglenest.stages.hidden_states.extract import extract_hidden_states
    from eaglenest.target_model.loading import load_target
    settings = settings_from_sections(HiddenSettings, hidden={"device": "cpu", "model_dtype": "float32",
                                                    "dtype": "fp32", "max_batch_tokens": 256},
                                      target={"path": sys.argv[1]})
    model = load_target(sys.argv[1], settings.device, settings.model_dtype)
    extract_hidden_states(tokens=sys.argv[2], out=sys.argv[3], settings=settings, model=model)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """
)


def test_memory_stays_bounded_as_the_shard_grows(demo_target_dir, tmp_path):
    """Peak RSS for 4N samples stays near that for N: the shard is never held in memory.

    Rows are wide (H=64 fp32, 4 x 64 floats per token): 4N samples are ~20 MB of file."""
    peaks = []
    for n in (500, 2000):
        tokens = write_tokens(tmp_path / f"{n}.parquet", n, seed=1)
        out = subprocess.run(
            [sys.executable, "-c", MEMORY_PROBE, str(demo_target_dir), str(tokens),
             str(tmp_path / f"{n}.safetensors")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        peaks.append(int(out.stdout.split()[-1]))  # KiB
        file_kib = (tmp_path / f"{n}.safetensors").stat().st_size / 1024
    assert file_kib > 15_000
    assert peaks[1] < 1.5 * peaks[0] + 8_000, peaks
    assert peaks[1] - peaks[0] < file_kib / 2, (peaks, file_kib)


def test_packed_batches_mix_lengths_and_pack_rows_under_the_budget():
    lengths = np.random.default_rng(0).integers(1, 100, size=200)
    batches = packed_batches(lengths, 256, np.random.default_rng(0))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    padded = 0
    for batch in batches:
        rows = packed_rows(lengths[batch], 256)
        longest = int(lengths[batch].max())
        width = pack_width(longest, 256)
        # The budget cut evenly into rows that each hold the longest sample.
        assert width == 256 // (256 // longest) >= longest
        assert sorted(i for r in rows for i in r) == list(range(len(batch)))
        assert all(sum(int(lengths[batch][i]) for i in r) <= width for r in rows)
        assert len(batch) == 1 or len(rows) * width <= 256
        padded += len(rows) * max(sum(int(lengths[batch][i]) for i in r) for r in rows)
    # Little padding although the lengths are mixed: rows packed nearly full (a batch's tensors
    # are as wide as its fullest row).
    assert lengths.sum() / padded > 0.85
    assert packed_batches(lengths, 256, np.random.default_rng(0)) == batches


def test_samples_too_long_to_pack_are_batched_from_length_sorted_pools():
    """Reasoning-length data (most samples over PACK_MAX_LENGTH, which go one to a row): batches
    new each epoch that still waste little padding. Drawn at random like the short samples, the
    long ones padded to each batch's longest computed about 2x their tokens at this budget."""
    from eaglenest.common.batching import PACK_MAX_LENGTH

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(3000), 0.9, 2000).astype(np.int64), 200, 32000)
    budget = 64 * 1024
    epochs = [packed_batches(lengths, budget, np.random.default_rng([0, e])) for e in range(2)]
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        computed = 0
        for batch in batches:
            sizes = lengths[batch]
            assert (sizes > PACK_MAX_LENGTH).all() or (sizes <= PACK_MAX_LENGTH).all()
            rows = packed_rows(sizes, budget)
            padded = len(rows) * max(int(sizes[row].sum()) for row in rows)
            assert len(batch) == 1 or padded <= budget
            computed += padded
        assert lengths.sum() / computed > 0.9
    assert {tuple(b) for b in epochs[0]} != {tuple(b) for b in epochs[1]}


def test_packed_rows_are_never_wider_than_the_packing_limit():
    from eaglenest.common.batching import PACK_MAX_LENGTH

    assert pack_width(130, 1024) == 146  # 7 rows
    assert pack_width(1500, 64 * 1024) == 1524  # 43 rows
    assert pack_width(1000, 4096) == 1024  # 4 rows
    assert pack_width(1500, 2500) == PACK_MAX_LENGTH  # 1 row, no wider than the limit
    assert pack_width(3000, 64 * 1024) == 3000  # not packed: as wide as the sample
    assert pack_width(100, 150) == 150 and pack_width(100, 50) == 100


def test_samples_longer_than_the_packing_limit_go_one_to_a_row():
    from eaglenest.common.batching import PACK_MAX_LENGTH

    assert pack_rows([PACK_MAX_LENGTH + 1, 10, 20]) == [[0], [1], [2]]
    assert pack_rows([PACK_MAX_LENGTH, 10, 20]) == [[0], [2, 1]]  # longest first
