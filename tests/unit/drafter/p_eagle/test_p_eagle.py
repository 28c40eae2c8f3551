"""P-EAGLE (eaglenest.drafter.p_eagle) on small random sizes: what goes wrong quietly. The
training forward against vLLM's parallel-drafting forward (one causal pass over the context, the
bonus token and K-1 mask slots with mask_hidden); no depth sees a later real token; packed rows;
the loss's alignment (EAGLE-3's) and depth weights (speculators' COD shares); a tiny drafter
learning; the export (the project's EAGLE-3 checkpoint plus mask_token_id and mask_hidden) and
the refusal of configs vLLM would read as another drafter."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from support.drafter_sizes import CONFIG

from eaglenest.drafter.batches import Batch
from eaglenest.drafter.eagle3.export import export_config
from eaglenest.drafter.export_files import ExportError, TrainedFor
from eaglenest.drafter.layers import DecodeCache, shift_left
from eaglenest.drafter.p_eagle.export import (
    check_p_eagle_exportable,
    export_p_eagle,
    load_p_eagle,
    p_eagle_export_config,
    p_eagle_from_export,
    p_eagle_speculative_config,
)
from eaglenest.drafter.p_eagle.loss import cod_depth_weights, parallel_loss
from eaglenest.drafter.p_eagle.model import PEagleDrafter
from eaglenest.stages.train.loss import ttt_loss

MASK = 49


def make_model(config=CONFIG) -> PEagleDrafter:
    torch.manual_seed(0)
    model = PEagleDrafter(config, MASK).double()
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
        for p in model.parameters():
            if p.ndim == 1 and p is not model.mask_hidden:  # norms away from 1
                p.uniform_(0.5, 1.5)
    d2t = torch.arange(0, 2 * CONFIG.draft_vocab_size, 2) - torch.arange(CONFIG.draft_vocab_size)
    t2d = torch.zeros(CONFIG.vocab_size, dtype=torch.bool)
    t2d[torch.arange(0, 2 * CONFIG.draft_vocab_size, 2)] = True
    model.set_vocab(d2t, t2d)
    return model.eval()


def inputs(batch: int = 2, length: int = 12):
    torch.manual_seed(1)
    aux = torch.randn(batch, length, 3 * CONFIG.target_hidden_size, dtype=torch.float64)
    ids = torch.randint(0, CONFIG.vocab_size, (batch, length))
    return aux, ids


def vllm_parallel_draft(model: PEagleDrafter, aux, ids, t: int, k: int) -> torch.Tensor:
    """[K, D]: what vLLM drafts at EAGLE-3 position t (v1/spec_decode/utils.py:429-541): one
    causal forward over positions 0..t (token x_p+1, fc(aux_p)) then t+1..t+K-1 (the mask token,
    fc(mask_hidden)), drafts at positions t..t+K-1."""
    tokens = torch.cat([ids[1 : t + 2], torch.full((k - 1,), MASK)])[None]
    hidden = torch.cat(
        [model.project(aux[: t + 1]), model.project(model.mask_hidden)[None].expand(k - 1, -1)]
    )[None]
    logits, _ = model.step(tokens, hidden, torch.arange(t + k)[None], DecodeCache())
    return logits[0, t:]


def test_every_depth_is_the_draft_of_vllms_parallel_forward():
    model = make_model()
    aux, ids = inputs(batch=1, length=12)
    with torch.no_grad():
        depths = model(aux, ids, 4)
        for t in (0, 3, 7):
            expected = vllm_parallel_draft(model, aux[0], ids[0], t, 4)
            for d in range(4):
                torch.testing.assert_close(depths[d][0, t], expected[d], rtol=1e-9, atol=1e-9)


def test_no_depth_sees_a_later_real_token_and_packed_rows_train_as_alone():
    model = make_model()
    aux, ids = inputs(batch=1, length=12)
    t = 5
    with torch.no_grad():
        before = model(aux, ids, 4)
        later_aux, later_ids = aux.clone(), ids.clone()
        later_aux[:, t + 1 :] += 1.0
        later_ids[:, t + 2 :] = (later_ids[:, t + 2 :] + 1) % CONFIG.vocab_size
        after = model(later_aux, later_ids, 4)
        for d in range(4):
            torch.testing.assert_close(after[d][:, : t + 1], before[d][:, : t + 1])
        segments = torch.tensor([[0] * 5 + [1] * 7])
        packed = model(aux, ids, 3, segments=segments)
        alone = model(aux[:, 5:], ids[:, 5:], 3)
        for d in range(3):
            torch.testing.assert_close(packed[d][:, 5:], alone[d])
    with pytest.raises(ValueError, match="ttt_inputs must be data"):
        model(aux, ids, 3, own_tokens=True)


def synthetic_batch(ids: torch.Tensor, aux: torch.Tensor, loss_mask: torch.Tensor) -> Batch:
    """The target predicts the data's next token, as a draft id (a fixed function of it)."""
    b, t = ids.shape
    following = torch.roll(ids, -1, dims=1) // 2 % CONFIG.draft_vocab_size
    target = torch.full((b, t, CONFIG.draft_vocab_size), -8.0, dtype=aux.dtype)
    target.scatter_(2, following[..., None], 0.0)
    in_vocab = torch.ones(b, t, dtype=torch.bool)
    in_vocab[:, 7] = False  # one position whose target argmax is outside the draft vocabulary
    return Batch(
        aux=aux,
        input_ids=ids,
        loss_mask=loss_mask,
        target_logits=target.log_softmax(-1),
        in_draft_vocab=in_vocab,
        samples=[],
    )


def test_the_loss_is_eagle3s_alignment_with_cod_depth_weights():
    model = make_model().float()
    aux, ids = inputs(batch=2, length=12)
    loss_mask = torch.zeros(2, 12, dtype=torch.bool)
    loss_mask[:, 4:] = True
    batch = synthetic_batch(ids, aux.float(), loss_mask)
    logits = model(aux.float(), ids, 4)
    # The same positions and per-depth losses as EAGLE-3's TTT loss for its steps.
    loss, stats = parallel_loss(logits, batch)
    _, ttt_stats = ttt_loss(logits, batch, step_weight=1.0)
    assert stats.counted == ttt_stats.counted
    assert stats.loss == pytest.approx(ttt_stats.loss)
    weights = cod_depth_weights(4)
    assert weights == pytest.approx([1.0, 0.7, 0.49, 0.343])
    assert cod_depth_weights(8)[5:] == [0.2, 0.2, 0.2]
    expected = sum(w * m * n for w, m, n in zip(weights, stats.loss, stats.counted, strict=True))
    expected /= sum(w * n for w, n in zip(weights, stats.counted, strict=True))
    assert float(loss.detach()) == pytest.approx(expected)
    # Depth d at t predicts position t + 1 + d's target: t + 1 + d in the answer, in vocab.
    for d in range(4):
        valid = shift_left(loss_mask, 1 + d, False) & shift_left(batch.in_draft_vocab, 1 + d, False)
        assert stats.counted[d] == int(valid.sum())


def test_a_tiny_p_eagle_drafter_learns_a_synthetic_answer():
    torch.manual_seed(2)
    model = PEagleDrafter(CONFIG, MASK)
    model.train()
    ids = (torch.arange(24) % 6 * 2).repeat(2, 1)
    aux = torch.randn(2, 24, 3 * CONFIG.target_hidden_size)
    loss_mask = torch.zeros(2, 24, dtype=torch.bool)
    loss_mask[:, 4:] = True
    batch = synthetic_batch(ids, aux, loss_mask)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(50):
        loss, _ = parallel_loss(model(aux, ids, 4), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert model.mask_hidden.grad is not None and model.mask_hidden.grad.abs().sum() > 0
    assert losses[-1] < 0.3 * losses[0], losses[::10]


def test_the_export_is_the_eagle3_checkpoint_with_the_mask_token_and_mask_hidden(tmp_path):
    model = make_model()
    export_p_eagle(model, tmp_path, depths=4, dtype="float32")
    config = json.loads((tmp_path / "config.json").read_text())
    eagle3 = export_config(model.config, "float32")
    assert set(config) == set(eagle3) | {"mask_token_id", "parallel_drafting"}
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["mask_token_id"] == MASK and config["parallel_drafting"] is True
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        mask_hidden = f.get_tensor("mask_hidden")
    assert "mask_hidden" in names and "embed_tokens.weight" not in names
    assert mask_hidden.shape == (3 * CONFIG.target_hidden_size,)  # vLLM: fc's input size
    loaded, depths = load_p_eagle(tmp_path, model.embed_tokens.weight.float(), [2, 4, 5])
    assert depths == 4
    aux, ids = inputs()
    with torch.no_grad():
        for a, b in zip(
            loaded(aux.float(), ids, 4), model.float()(aux.float(), ids, 4), strict=True
        ):
            torch.testing.assert_close(a, b)
    assert p_eagle_speculative_config(tmp_path, 3, depths) == {
        "method": "eagle3",
        "model": str(tmp_path),
        "num_speculative_tokens": 3,
        "parallel_drafting": True,
    }
    with pytest.raises(ValueError, match="drafts 1..4"):
        p_eagle_speculative_config(tmp_path, 5, depths)


def test_the_export_records_what_the_drafter_was_trained_with(tmp_path):
    """The `eaglenest` record beside P-EAGLE's own entries: a window for each of its layers."""
    torch.manual_seed(0)
    model = PEagleDrafter(replace(CONFIG, sliding_window=8), MASK, num_hidden_layers=3)
    trained = TrainedFor(trained_positions=300, served_length=1024)
    export_p_eagle(model, tmp_path, depths=3, dtype="float32", trained=trained)
    config = json.loads((tmp_path / "config.json").read_text())
    record = config["eaglenest"]
    assert (
        record["sliding_window"] == [8, 8, 8] and config["layer_types"] == ["sliding_attention"] * 3
    )
    assert record["trained_positions"] == 300 and record["served_length"] == 1024
    assert record["rope"] == {"rope_theta": CONFIG.rope_theta, "rope_scaling": None}
    assert record["depths"] == 3 and record["mask_token_id"] == MASK  # P-EAGLE's, kept


MISREAD = {
    "a dflash_config mask token (vLLM reads it first)": lambda c: c.update(
        dflash_config={"mask_token_id": 3}
    ),
    "another mask token": lambda c: c.update(mask_token_id=3),
    "no mask token but a pard_token": lambda c: (c.pop("mask_token_id"), c.update(pard_token=7)),
    "no mask token at all": lambda c: c.pop("mask_token_id"),
    "other captured layers": lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4]),
    "an MLA drafter": lambda c: c.update(architectures=["Eagle3DeepseekV3ForCausalLM"]),
    "two layers": lambda c: c.update(num_hidden_layers=2),
}


@pytest.mark.parametrize("edit", list(MISREAD))
def test_a_config_vllm_would_read_as_another_drafter_is_refused(edit):
    config = json.loads(json.dumps(p_eagle_export_config(make_model(), "float32", depths=4)))
    p_eagle_from_export(json.loads(json.dumps(config)))  # as exported: accepted
    MISREAD[edit](config)
    with pytest.raises(ExportError):
        p_eagle_from_export(config)


def test_an_export_without_mask_hidden_or_with_mla_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = make_model()
    export_p_eagle(model, tmp_path, depths=3, dtype="float32")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["mask_hidden"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ExportError, match="mask_hidden"):
        load_p_eagle(tmp_path, model.embed_tokens.weight.float())
    mla = replace(
        CONFIG,
        attention="mla",
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        head_dim=16,
        num_key_value_heads=4,
    )
    with pytest.raises(ExportError, match="mask_hidden"):
        check_p_eagle_exportable(mla)
    with pytest.raises(ValueError, match="mask_token_id"):
        PEagleDrafter(CONFIG, CONFIG.vocab_size)
