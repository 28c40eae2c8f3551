"""DFlash (eaglenest.drafter.dflash: model, loss, export) on small random sizes: what goes wrong
quietly. The block attention (non-causal inside the block, the context strictly before the anchor,
no later real token, no other block, no other sample) against a plain per-anchor forward written
as vLLM computes it; anchors; the layer-id translation; the loss's alignment and weights; a tiny
drafter learning; the export's keys and tensor names exactly as vLLM 0.32 loads them
(VLLM-FAMILIES.md), and the refusal of configs vLLM would read as another drafter."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from support.drafter_sizes import CONFIG

from eaglenest.drafter.batches import Batch
from eaglenest.drafter.dflash.export import (
    dflash_config_from_export,
    dflash_speculative_config,
    export_dflash,
    load_dflash,
    vllm_aux_layer_ids,
)
from eaglenest.drafter.dflash.loss import (
    block_targets,
    dflash_loss,
    position_weights,
    select_anchors,
)
from eaglenest.drafter.dflash.model import (
    DFlashConfig,
    DFlashDrafter,
    aux_layer_ids_from_dflash,
    block_attention_mask,
    dflash_target_layer_ids,
)
from eaglenest.drafter.export_files import ExportError, TrainedFor

MASK = 49
DCONFIG = DFlashConfig.from_drafter(CONFIG, num_hidden_layers=2, block_size=4, mask_token_id=MASK)


def make_model(config: DFlashConfig = DCONFIG) -> DFlashDrafter:
    torch.manual_seed(0)
    model = DFlashDrafter(config).double()
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
        for p in model.parameters():
            if p.ndim == 1:  # norms away from 1, so a norm in the wrong place shows
                p.uniform_(0.5, 1.5)
    return model.eval()


def inputs(batch: int = 2, length: int = 14):
    torch.manual_seed(1)
    aux = torch.randn(batch, length, 3 * CONFIG.target_hidden_size, dtype=torch.float64)
    ids = torch.randint(0, CONFIG.vocab_size, (batch, length))
    return aux, ids


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox rotary (vLLM's default for DFlash, qwen3_dflash.py:357), written out: x [n, heads,
    d] at integer positions [n]."""
    half = x.shape[-1] // 2
    freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) / half)
    angle = positions.double()[:, None] * freq  # [n, half]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def reference_block(model: DFlashDrafter, aux, ids, anchor: int) -> torch.Tensor:
    """[bs, D] logits of one row's block at `anchor`, as vLLM computes a draft: context K/V from
    hidden_norm(fc(aux)) of positions < anchor (k_norm, rotary, no input_layernorm); queries
    [x_anchor, mask, ...] at positions anchor.. ; softmax over every context and block key."""
    c = model.config
    size, heads, kv, d = c.block_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    context = model.hidden_norm(model.fc(aux[:anchor]))
    h = model.embed_tokens(torch.tensor([int(ids[anchor])] + [c.mask_token_id] * (size - 1)))
    ctx_pos, blk_pos = torch.arange(anchor), torch.arange(anchor, anchor + size)
    for layer in model.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = rotate(a.q_norm(a.q_proj(x).view(size, heads, d)), blk_pos, c.rope_theta)
        k = torch.cat(
            [
                rotate(a.k_norm(a.k_proj(context).view(anchor, kv, d)), ctx_pos, c.rope_theta),
                rotate(a.k_norm(a.k_proj(x).view(size, kv, d)), blk_pos, c.rope_theta),
            ]
        ).repeat_interleave(heads // kv, 1)
        v = torch.cat([a.v_proj(context), a.v_proj(x)]).view(-1, kv, d)
        v = v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(size, -1)
        h = h + a.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.norm(h))


def test_each_block_is_the_forward_vllm_computes_for_its_anchor():
    model = make_model()
    aux, ids = inputs()
    anchors = torch.tensor([[3, 5, 10], [1, 7, -1]])
    with torch.no_grad():
        logits = model(aux, ids, anchors)
        for row in range(2):
            for n, anchor in enumerate(anchors[row].tolist()):
                if anchor >= 0:
                    expected = reference_block(model, aux[row], ids[row], anchor)
                    # rope_cos_sin's angles are float32: agreement to float32's precision.
                    torch.testing.assert_close(logits[row, n], expected, rtol=1e-5, atol=1e-6)


def test_the_block_mask_is_non_causal_inside_causal_to_the_context():
    anchors = torch.tensor([[2, 5]])
    mask = block_attention_mask(anchors, t=8, block_size=3)[0, 0]  # [6, 8 + 6]
    context, blocks = mask[:, :8], mask[:, 8:]
    for q in range(6):
        anchor = int(anchors[0, q // 3])
        assert context[q].tolist() == [s < anchor for s in range(8)]  # not the anchor itself
        assert blocks[q].tolist() == [k // 3 == q // 3 for k in range(6)]  # all of its block
    missing = block_attention_mask(torch.tensor([[4, -1]]), t=8, block_size=3)[0, 0]
    assert not missing[3:, :8].any() and missing[3:, 8 + 3 :].all()


def test_a_block_never_sees_a_later_real_token_another_block_or_another_sample():
    model = make_model()
    aux, ids = inputs(batch=1, length=14)
    anchors = torch.tensor([[4, 9]])
    with torch.no_grad():
        before = model(aux, ids, anchors)
        later_aux, later_ids = aux.clone(), ids.clone()
        later_aux[:, 4:] += 1.0  # the anchor's own aux state and everything after it
        later_ids[:, 5:] = (later_ids[:, 5:] + 1) % CONFIG.vocab_size
        after = model(later_aux, later_ids, anchors)
        torch.testing.assert_close(after[:, 0], before[:, 0])  # the block at 4 saw none of it
        assert not torch.allclose(after[:, 1], before[:, 1])  # the block at 9 sees them
        alone = model(aux, ids, anchors[:, :1])
        torch.testing.assert_close(alone[:, 0], before[:, 0])  # the other block is invisible
        earlier_aux = aux.clone()
        earlier_aux[:, 3] += 1.0
        assert not torch.allclose(model(earlier_aux, ids, anchors)[:, 0], before[:, 0])
        # Two samples packed in one row: the second's blocks see only its own context.
        segments = torch.tensor([[0] * 6 + [1] * 8])
        packed = model(aux, ids, torch.tensor([[9]]), segments)
        own = model(aux[:, 6:], ids[:, 6:], torch.tensor([[3]]))
        torch.testing.assert_close(packed, own)


def test_anchors_are_answer_positions_whose_next_token_is_in_the_answer_with_context_before():
    """The references' rule (SpecForge, speculators): no room for the whole block needed."""
    loss_mask = torch.zeros(3, 12, dtype=torch.bool)
    loss_mask[0, 4:10] = True  # answer 4..9 (9: the end of turn), then padding
    loss_mask[1, 0:12] = True  # an answer from the first token: no context at 0
    loss_mask[2, 2:4] = True  # an answer of 2 tokens, shorter than any block
    anchors = select_anchors(loss_mask, block_size=8)
    assert anchors[0].tolist()[:5] == [4, 5, 6, 7, 8]  # 8: its slot 1 is the end of turn
    assert anchors[1].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 11: the row's last
    assert anchors[2].tolist()[:1] == [2] and (anchors[2, 1:] == -1).all()
    # Packed rows: a sample's last token anchors nothing (its next is the next sample's), the
    # next sample's first has no context.
    segments = torch.tensor([[0] * 6 + [1] * 6])
    packed = select_anchors(torch.ones(1, 12, dtype=torch.bool), 3, segments=segments)
    assert packed[0].tolist() == [1, 2, 3, 4, 7, 8, 9, 10]
    some = select_anchors(loss_mask, 4, max_anchors=2, generator=torch.Generator().manual_seed(0))
    assert some.shape == (3, 2) and set(some[1].tolist()) <= set(range(1, 11))
    assert some[1, 0] < some[1, 1]


def test_the_end_of_turn_is_slot_1_of_the_anchor_before_it_and_slots_past_the_answer_are_masked():
    aux, ids = inputs(batch=1, length=12)
    loss_mask = torch.zeros(1, 12, dtype=torch.bool)
    loss_mask[0, 3:9] = True  # answer 3..8, 8 its end of turn; 9.. padding
    batch = batch_for(ids, aux, loss_mask)
    anchors = select_anchors(loss_mask, block_size=4)
    assert anchors[0].tolist() == [3, 4, 5, 6, 7]
    targets, valid = block_targets(batch, anchors, 4)
    assert valid[0, -1].tolist() == [False, True, False, False]  # anchor 7: x_8 at slot 1
    torch.testing.assert_close(targets[0, -1, 1], batch.target_logits[0, 7])
    assert valid[0, -2].tolist() == [False, True, True, False]  # anchor 6: x_7, x_8, then out
    # Past the sample in a packed row, and past the row.
    packed = replace(batch, loss_mask=torch.ones(1, 12, dtype=torch.bool))
    packed.segments = torch.tensor([[0] * 6 + [1] * 6])
    _, valid = block_targets(packed, torch.tensor([[4, 10]]), 4)
    assert valid[0].tolist() == [[False, True, False, False], [False, True, False, False]]


def test_an_answer_of_two_tokens_trains_a_block_of_8():
    config = replace(DCONFIG, block_size=8)
    model = make_model(config)
    aux, ids = inputs(batch=1, length=12)
    loss_mask = torch.zeros(1, 12, dtype=torch.bool)
    loss_mask[0, 6:8] = True
    batch = batch_for(ids, aux, loss_mask)
    anchors = select_anchors(loss_mask, config.block_size)
    assert anchors.tolist() == [[6]]
    loss, stats = dflash_loss(model(aux, ids, anchors), batch, anchors)
    assert stats.counted == [1, 0, 0, 0, 0, 0, 0]  # x_7 at slot 1, nothing past the answer
    loss.backward()
    assert float(loss) > 0 and model.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "own, gamma",
    [({"block_size": 8}, 4.0), ({"block_size": 16}, 7.0), ({"block_size": 16, "gamma": 2.5}, 2.5)],
)
def test_gamma_follows_the_block_unless_set(own, gamma):
    from eaglenest.settings.families import DFlashSettings

    own = {"num_hidden_layers": 5, "max_anchors": 512, "gamma": None, "head": "target", **own}
    assert DFlashSettings.from_config({"train": {"dflash": own}}).gamma == gamma
    with pytest.raises(ValueError, match="train.dflash.head"):
        DFlashSettings.from_config({"train": {"dflash": {**own, "head": "tied"}}})


def test_the_layer_ids_are_translated_as_vllm_adds_one():
    """Ours are the input of decoder layer k (hidden_states[k]); DFlash's the output of layer i
    (hidden_states[i + 1]); vLLM 0.32 captures target_layer_ids + 1 (gpu_model_runner.py:5274),
    measured: [1, 3, 4] fed hidden_states [2, 4, 5] (VLLM-FAMILIES.md)."""
    assert dflash_target_layer_ids((2, 4, 5)) == [1, 3, 4]
    assert aux_layer_ids_from_dflash([1, 3, 4]) == (2, 4, 5)
    assert vllm_aux_layer_ids({"dflash_config": {"target_layer_ids": [1, 3, 4]}}) == (2, 4, 5)
    # The EAGLE-3 key wins over dflash_config's when both are there (gpu_model_runner.py:5268).
    both = {"eagle_aux_hidden_state_layer_ids": [7], "dflash_config": {"target_layer_ids": [1]}}
    assert vllm_aux_layer_ids(both) == (7,)
    with pytest.raises(ValueError, match="id 0"):
        dflash_target_layer_ids((0, 4, 5))


def batch_for(ids: torch.Tensor, aux: torch.Tensor, loss_mask: torch.Tensor) -> Batch:
    """The target predicts the data's next token, as a draft id (even target ids are draft
    ids: `vocab_maps`; others fold onto them, which only needs to be a fixed function here)."""
    b, t = ids.shape
    following = torch.roll(ids, -1, dims=1) // 2 % CONFIG.draft_vocab_size
    target = torch.full((b, t, CONFIG.draft_vocab_size), -8.0, dtype=aux.dtype)
    target.scatter_(2, following[..., None], 0.0)
    return Batch(
        aux=aux,
        input_ids=ids,
        loss_mask=loss_mask,
        target_logits=target.log_softmax(-1),
        in_draft_vocab=torch.ones(b, t, dtype=torch.bool),
        samples=[],
    )


def test_slot_j_learns_the_targets_distribution_at_anchor_plus_j_minus_one():
    aux, ids = inputs(batch=1, length=12)
    loss_mask = torch.zeros(1, 12, dtype=torch.bool)
    loss_mask[0, 3:11] = True
    batch = batch_for(ids, aux, loss_mask)
    anchors = torch.tensor([[3, 7]])
    targets, valid = block_targets(batch, anchors, 4)
    for n, anchor in enumerate([3, 7]):
        for j in range(1, 4):
            torch.testing.assert_close(targets[0, n, j], batch.target_logits[0, anchor + j - 1])
    assert valid[0, :, 0].tolist() == [False, False]  # the anchor slot is not trained
    assert valid[0, 0, 1:].all()
    assert valid[0, 1].tolist() == [False, True, True, True]
    weights = position_weights(4, gamma=4.0)
    assert weights == pytest.approx([0.0, 1.0, math.exp(-1 / 4), math.exp(-2 / 4)])


def test_a_tiny_dflash_drafter_learns_a_synthetic_answer():
    torch.manual_seed(2)
    model = DFlashDrafter(DCONFIG)
    model.train()
    ids = (torch.arange(24) % 6 * 2).repeat(2, 1)  # even ids: draft ids 0, 1, ..., 5, 0, ...
    aux = torch.randn(2, 24, 3 * CONFIG.target_hidden_size)
    loss_mask = torch.zeros(2, 24, dtype=torch.bool)
    loss_mask[:, 4:] = True
    batch = batch_for(ids, aux, loss_mask)
    anchors = select_anchors(loss_mask, DCONFIG.block_size)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(50):
        loss, stats = dflash_loss(model(aux, ids, anchors), batch, anchors)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert len(stats.counted) == DCONFIG.block_size - 1  # the K drafted slots
    assert losses[-1] < 0.3 * losses[0], losses[::10]


MEASURED_KEYS = {  # the config.json vLLM 0.32 served (VLLM-FAMILIES.md (a))
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "vocab_size",
    "attention_bias",
    "tie_word_embeddings",
    "dtype",
    "num_target_layers",
    "block_size",
    "dflash_config",
}
# ... and what vLLM reads that the measured drafter (full vocabulary, the target's hidden size)
# left out, and our record of the trained drafter.
ADDED_KEYS = {"draft_vocab_size", "target_hidden_size", "eaglenest"}


def layer_names(i: int) -> set[str]:
    attn = {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
    norms = {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
    mlp = {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    ln = {f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")}
    return attn | norms | mlp | ln


def test_the_export_has_the_keys_and_tensor_names_vllm_loads_and_reloads_the_same(tmp_path):
    model = make_model()
    model.set_vocab(*vocab_maps(DCONFIG))
    export_dflash(model, tmp_path, dtype="float32", num_target_layers=8)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config) == MEASURED_KEYS | ADDED_KEYS
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "block_size": 4,
        "mask_token_id": MASK,
        "target_layer_ids": [1, 3, 4],
    }
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    expected = layer_names(0) | layer_names(1) | {"fc.weight", "hidden_norm.weight"}
    assert names == expected | {"norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert dflash_speculative_config(tmp_path, DCONFIG)["num_speculative_tokens"] == 3
    loaded = load_dflash(tmp_path, model.embed_tokens.weight.float(), expect_layer_ids=[2, 4, 5])
    aux, ids = inputs()
    anchors = torch.tensor([[3, 6], [2, 8]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(aux.float(), ids, anchors), model.float()(aux.float(), ids, anchors)
        )
    with pytest.raises(ExportError, match="captured at"):
        load_dflash(tmp_path, model.embed_tokens.weight.float(), expect_layer_ids=[1, 2, 3])


def test_the_export_records_what_the_drafter_was_trained_with(tmp_path):
    """The `eaglenest` record beside the trained config: the target's YaRN as trained, full
    attention in each layer, the positions trained and served."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    config = replace(DCONFIG, rope_scaling=yarn, max_position_embeddings=256)
    model = make_model(config)
    model.set_vocab(*vocab_maps(config))
    trained = TrainedFor(trained_positions=200, served_length=256)
    export_dflash(model, tmp_path, dtype="float32", trained=trained)
    exported = json.loads((tmp_path / "config.json").read_text())
    record = exported["eaglenest"]
    assert record["rope"] == {"rope_theta": 10000.0, "rope_scaling": yarn}
    assert exported["rope_parameters"] == {"rope_theta": 10000.0, **yarn}  # what vLLM reads
    assert record["sliding_window"] == [None, None]
    assert record["trained_positions"] == 200 and record["served_length"] == 256
    assert dflash_config_from_export(exported) == model.config  # the record reads back


def vocab_maps(config: DFlashConfig) -> tuple[torch.Tensor, torch.Tensor]:
    draft_ids = torch.arange(0, 2 * config.draft_vocab_size, 2)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return draft_ids - torch.arange(config.draft_vocab_size), t2d


def test_a_full_vocabulary_ships_no_d2t(tmp_path):
    config = replace(DCONFIG, draft_vocab_size=CONFIG.vocab_size)
    model = make_model(config)
    model.set_vocab(
        torch.zeros(config.vocab_size, dtype=torch.long),
        torch.ones(config.vocab_size, dtype=torch.bool),
    )
    export_dflash(model, tmp_path, dtype="float32")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert not {"d2t", "t2d"} & set(f.keys())
    load_dflash(tmp_path, model.embed_tokens.weight.float())


# Each edit makes vLLM 0.32 serve another drafter than the one trained.
MISREAD = {
    "causal at the top": lambda c: c.update(is_causal=True),
    "causal in dflash_config": lambda c: c["dflash_config"].update(causal=True),
    "a sliding layer": lambda c: c.update(layer_types=["sliding_attention", "full_attention"]),
    "transformers' sliding default": lambda c: c.update(
        use_sliding_window=True, max_window_layers=1
    ),
    "every layer sliding": lambda c: c["dflash_config"].update(use_swa=True, swa_window_size=8),
    "other target layers": lambda c: c["dflash_config"].update(target_layer_ids=[2, 4, 5]),
    "an EAGLE-3 layer list": lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4]),
    "an eagle_config": lambda c: c.update(eagle_config={"use_aux_hidden_state": True}),
    "another mask token": lambda c: c["dflash_config"].update(mask_token_id=3),
    "no rotary base": lambda c: c.pop("rope_parameters"),
    "another rotary base": lambda c: c["rope_parameters"].update(rope_theta=1e6),
    "interleaved rotary": lambda c: c.update(is_neox_style=False),
    "sampling from the anchor": lambda c: c["dflash_config"].update(sample_from_anchor=True),
    "a value scale": lambda c: c["dflash_config"].update(attention_value_scale=0.5),
    "another architecture": lambda c: c.update(architectures=["DFlash2DraftModel"]),
    "another head count": lambda c: c.update(num_attention_heads=2),
}


@pytest.mark.parametrize("edit", list(MISREAD))
def test_a_config_vllm_would_read_as_another_drafter_is_refused(edit):
    config = json.loads(json.dumps(export_config_of(DCONFIG)))
    dflash_config_from_export(copy.deepcopy(config))  # as exported: accepted
    MISREAD[edit](config)
    with pytest.raises(ExportError, match="vLLM 0.32 would serve another drafter"):
        dflash_config_from_export(config)


def export_config_of(config: DFlashConfig) -> dict:
    from eaglenest.drafter.dflash.export import dflash_export_config

    return dflash_export_config(config, "float32", num_target_layers=8)


def test_a_mask_hidden_tensor_is_refused_on_load(tmp_path):
    """vLLM asserts a DFlash checkpoint has none (qwen3_dflash.py:891)."""
    from safetensors.torch import load_file, save_file

    model = make_model()
    model.set_vocab(*vocab_maps(DCONFIG))
    export_dflash(model, tmp_path, dtype="float32")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["mask_hidden"] = torch.zeros(3 * CONFIG.target_hidden_size)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ExportError, match="mask_hidden"):
        load_dflash(tmp_path, model.embed_tokens.weight.float())


def test_a_drafter_config_dflash_cannot_serve_is_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        DFlashConfig.from_drafter(
            replace(CONFIG, sliding_window=16), num_hidden_layers=1, block_size=4, mask_token_id=1
        )
    with pytest.raises(ValueError, match="mask_token_id"):
        replace(DCONFIG, mask_token_id=CONFIG.vocab_size)
    with pytest.raises(ValueError, match="block_size"):
        replace(DCONFIG, block_size=1)


def test_blocks_in_chunks_give_the_logits_and_gradients_of_one_call(monkeypatch):
    from eaglenest.drafter.dflash import model as dflash

    model = make_model()
    aux, ids = inputs(batch=2, length=40)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 6:] = True
    anchors = select_anchors(loss_mask, DCONFIG.block_size)
    assert anchors.shape[1] > 8

    def run(chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        monkeypatch.setattr(dflash, "ANCHOR_CHUNK", chunk)
        model.zero_grad()
        logits = model(aux, ids, anchors)
        (logits.square().mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    whole, whole_grads = run(1000)
    chunked, chunked_grads = run(3)  # several chunks, each recomputed in backward
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    assert chunked_grads.keys() == whole_grads.keys()
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6)


# The references' layout: the target's LM head over its whole vocabulary, frozen, never exported.
TARGET_CONFIG = DFlashConfig.from_drafter(
    CONFIG, num_hidden_layers=5, block_size=16, mask_token_id=MASK, head="target"
)


def test_the_target_head_layout_exports_no_head_and_reloads_at_5_layers_and_block_16(tmp_path):
    assert TARGET_CONFIG.draft_vocab_size == CONFIG.vocab_size
    model = make_model(TARGET_CONFIG)
    model.set_vocab(
        torch.zeros(CONFIG.vocab_size, dtype=torch.long),
        torch.ones(CONFIG.vocab_size, dtype=torch.bool),
    )
    export_dflash(model, tmp_path, dtype="float32", gamma=7.0)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dflash_config"]["block_size"] == 16 and config["num_hidden_layers"] == 5
    assert config["draft_vocab_size"] == config["vocab_size"] == CONFIG.vocab_size
    assert config["eaglenest"]["gamma"] == 7.0
    assert config["eaglenest"]["config"]["head"] == "target"
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    expected = set().union(*(layer_names(i) for i in range(5)))
    assert names == expected | {"fc.weight", "hidden_norm.weight", "norm.weight"}
    embed, head = model.embed_tokens.weight.float(), model.lm_head.weight.float()
    with pytest.raises(ExportError, match="needs the target's LM head"):
        load_dflash(tmp_path, embed)
    loaded = load_dflash(tmp_path, embed, lm_head=head)
    aux, ids = inputs(length=40)
    anchors = torch.tensor([[3, 20], [2, 8]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(aux.float(), ids, anchors), model.float()(aux.float(), ids, anchors)
        )


def test_the_target_head_and_embedding_get_no_gradient_and_the_loss_is_over_the_whole_vocab():
    config = replace(TARGET_CONFIG, num_hidden_layers=1, block_size=4)
    model = make_model(config).train()
    aux, ids = inputs(batch=1, length=12)
    loss_mask = torch.zeros(1, 12, dtype=torch.bool)
    loss_mask[0, 3:11] = True
    batch = batch_for(ids, aux, loss_mask)  # its target is over the draft vocabulary
    draft_ids, _ = vocab_maps(DCONFIG)
    draft_ids = draft_ids + torch.arange(DCONFIG.draft_vocab_size)  # target id of draft id
    anchors = select_anchors(loss_mask, config.block_size)
    logits = model(aux, ids, anchors)
    assert logits.shape[-1] == CONFIG.vocab_size
    loss, stats = dflash_loss(logits, batch, anchors, draft_ids=draft_ids)
    loss.backward()
    assert model.lm_head.weight.grad is None and model.embed_tokens.weight.grad is None
    assert model.fc.weight.grad.abs().sum() > 0
    # Slot 1's mean loss: -log of the whole vocabulary's softmax at the target id of the
    # target's argmax draft token.
    _, valid = block_targets(batch, anchors, config.block_size)
    slot_1 = -torch.stack(
        [
            logits[0, n, 1].log_softmax(-1)[draft_ids[batch.target_logits[0, a].argmax()]]
            for n, a in enumerate(anchors[0].tolist())
            if valid[0, n, 1]
        ]
    ).mean()
    torch.testing.assert_close(stats.loss[0], float(slot_1))
    assert "lm_head.weight" not in model.trainable_state_dict()
