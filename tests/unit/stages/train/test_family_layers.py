"""Each family trains on its own layers of one capture: the hidden-state stage keeps the union of
train.families' defaults once (the demo target's 8 layers: EAGLE-3's 2, 4, 5 and DFlash's
2 to 6), and the train feed cuts each batch's aux to the family's columns, in the captured order:
what the target's hidden_states hold at those layers, read from a shard the stage wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.kimi_shape import write_tokens

from eaglenest.common.config import settings_from_sections
from eaglenest.drafter.batches import BatchPlan, aux_columns, build_batch
from eaglenest.formats.hidden_shard import open_hidden_shard
from eaglenest.settings.families import family_layer_ids
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.stages.hidden_states.extract import extract_hidden_states
from eaglenest.stages.train.distributed import Processes
from eaglenest.stages.train.feed import step_batches
from eaglenest.target_model.loading import load_target

torch.set_num_threads(1)
FAMILIES = ["eagle3", "p_eagle", "dflash"]


@pytest.fixture(scope="module")
def captured(demo_target_dir, tmp_path_factory) -> tuple[Path, object]:
    """One shard of the union, captured in float32 by the hidden-state stage, and the target."""
    out = tmp_path_factory.mktemp("union")
    target = load_target(demo_target_dir, device="cpu", model_dtype="float32")
    settings = settings_from_sections(
        HiddenSettings,
        hidden={"device": "cpu", "model_dtype": "float32", "dtype": "fp32"},
        target={"model": "demo", "path": str(demo_target_dir)},
        train={"families": FAMILIES},
    )
    tokens = write_tokens(out / "00000.parquet", [7, 19, 12, 30, 4])
    extract_hidden_states(tokens=tokens, out=out / "00000.safetensors", settings=settings,
                          summary_out=out / "00000.json", model=target)  # fmt: skip
    return out / "00000.safetensors", target


def test_the_capture_holds_the_union_once(captured):
    path, _ = captured
    with safe_open(str(path), framework="pt") as f:
        assert f.get_slice("aux").get_shape()[1] == 5 * 64
    assert open_hidden_shard(path).aux_layer_ids == [2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("family", "chosen", "layers"),
    [
        ("eagle3", None, (2, 4, 5)),
        ("dflash", None, (2, 3, 4, 5, 6)),
        ("dflash", [6, 3], (3, 6)),  # chosen out of order: read in the captured order
    ],
)
def test_the_feed_gives_each_family_the_captured_columns_of_its_layers(
    captured, family, chosen, layers
):
    path, target = captured
    shard = open_hidden_shard(path)
    assert family_layer_ids(family, chosen, shard.aux_layer_ids, 8) == layers
    for packed in (False, True):
        plan = BatchPlan([shard], 4096, seed=0, packed=packed, aux_layer_ids=layers)
        batches = list(step_batches(plan, 0, 1, [1], Processes()))
        (_, _, batch), refs = batches[0], plan.epoch_order(0)[0]
        assert batch.aux.shape[-1] == len(layers) * 64
        if packed:  # one row of every sample: compare each sample's span with its own
            batch = build_batch(refs, plan.shards, plan.aux_layer_ids)
        for row, ref in enumerate(refs):
            ids = batch.input_ids[row, : ref.length]
            with torch.inference_mode():
                states = target(ids[None], output_hidden_states=True).hidden_states
            want = torch.cat([states[k][0] for k in layers], dim=-1)
            torch.testing.assert_close(batch.aux[row, : ref.length], want, atol=1e-5, rtol=1e-4)


def test_a_layer_not_captured_has_no_columns():
    assert aux_columns([2, 4, 5], [2, 4, 5], 8) is None  # every layer: nothing cut
    assert aux_columns([2, 3, 4], [4, 2], 2).tolist() == [4, 5, 0, 1]
    with pytest.raises(ValueError, match=r"reads layers \[7\], not captured \(\[2, 3, 4\]\)"):
        aux_columns([2, 3, 4], [7], 2)
