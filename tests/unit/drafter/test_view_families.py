"""Every family on a view of a sample (train.sequence: a sink, then a window at depth, each at its
true rotary positions; eaglenest.drafter.views): its forward equals the forward on the whole
sample where the context is the same (the whole sample's attention restricted to the kept keys),
the positions matter, and its loss never trains a target across the seam."""

from __future__ import annotations

import pytest
import torch
from support.drafter_sizes import CONFIG

import eaglenest.drafter.dflash.model as dflash_module
import eaglenest.drafter.eagle3.model as eagle3_module
import eaglenest.drafter.p_eagle.model as p_eagle_module
from eaglenest.drafter.batches import Batch
from eaglenest.drafter.dflash.loss import block_targets, select_anchors
from eaglenest.drafter.dflash.model import DFlashConfig, DFlashDrafter
from eaglenest.drafter.eagle3.model import Eagle3Drafter
from eaglenest.drafter.p_eagle.loss import depth_valid
from eaglenest.drafter.p_eagle.model import PEagleDrafter
from eaglenest.drafter.views import SampleView
from eaglenest.stages.train.loss import ttt_loss

N = 20
VIEW = SampleView(sink=4, start=11, stop=20)  # positions 0..3, then 11..19
KEPT = VIEW.positions()
SINK_END, END = VIEW.sink, VIEW.length
STEPS = 3
MASK = 49


def seeded(model: torch.nn.Module) -> torch.nn.Module:
    model = model.double()
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
        for p in model.parameters():
            if p.ndim == 1 and p.shape[0] == CONFIG.hidden_size:  # norms away from 1
                p.uniform_(0.5, 1.5)
    return model.eval()


def sample() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    aux = torch.randn(1, N, 3 * CONFIG.target_hidden_size, dtype=torch.float64)
    return aux, torch.randint(0, CONFIG.vocab_size, (1, N))


def kept_keys() -> torch.Tensor:
    """[1, 1, N, N]: causal, and only the view's rows as keys (the whole sample's attention as
    the view's)."""
    kept = torch.zeros(N, dtype=torch.bool)
    kept[KEPT] = True
    return (torch.ones(N, N, dtype=torch.bool).tril() & kept[None, :])[None, None]


def restricted(monkeypatch, module) -> None:
    """The module's rows see only the kept keys, at positions from 0 (the whole sample's)."""
    monkeypatch.setattr(
        module, "row_positions", lambda segments, b, t, device: (torch.arange(t)[None], kept_keys())
    )


def same_span(offset: int) -> list[int]:
    """The view's rows whose row `offset` on is in the same span (sink or window)."""
    return [u for u in range(END) if (u < SINK_END) == (u + offset < SINK_END) and u + offset < END]


def comparable(reach: int) -> list[int]:
    """The view's rows whose inputs reach at most `reach` rows on within their span, a sink's
    rows up to the token after it, which the window's first row holds (`view_ids`)."""
    return sorted({*same_span(reach), *(u for u in range(SINK_END) if u + reach == SINK_END)})


def view_ids(ids: torch.Tensor) -> torch.Tensor:
    """The view's tokens as a batch holds them: the window's first row holds the token after the
    sink (eaglenest.drafter.views `seam_row`)."""
    viewed = ids[:, KEPT].clone()
    viewed[:, VIEW.seam_row] = ids[:, SINK_END]
    return viewed


@pytest.mark.parametrize("family", ["eagle3", "p_eagle"])
def test_a_view_at_true_positions_is_the_whole_sample_seen_through_it(family, monkeypatch):
    torch.manual_seed(0)
    if family == "eagle3":
        model, module = seeded(Eagle3Drafter(CONFIG)), eagle3_module
        reach = STEPS  # step i reads the token i + 1 rows on
    else:
        model, module = seeded(PEagleDrafter(CONFIG, MASK)), p_eagle_module
        reach = 1  # depths >= 1 read the mask token
    aux, ids = sample()
    with torch.no_grad():
        viewed = model(aux[:, KEPT], view_ids(ids), STEPS, positions=KEPT[None])
        from_zero = model(aux[:, KEPT], view_ids(ids), STEPS)
        restricted(monkeypatch, module)
        whole = model(aux, ids, STEPS)
    rows = comparable(reach)
    assert len(rows) >= 6
    for step in range(STEPS):
        torch.testing.assert_close(viewed[step][0, rows], whole[step][0, KEPT[rows]])
    window = [u for u in rows if u >= SINK_END]
    assert not torch.allclose(viewed[0][0, window], from_zero[0][0, window])  # positions matter


def test_a_dflash_block_in_a_view_is_the_whole_samples_block(monkeypatch):
    torch.manual_seed(0)
    config = DFlashConfig.from_drafter(
        CONFIG, num_hidden_layers=2, block_size=4, mask_token_id=MASK
    )
    model = seeded(DFlashDrafter(config))
    aux, ids = sample()
    anchors = torch.tensor([[2, 5, 8, 12]])  # none at the window's first row (select_anchors)
    mask_of = dflash_module.block_attention_mask

    def kept_context(anchors_, t, size, segments=None):
        mask = mask_of(anchors_, t, size, segments).clone()
        mask[..., :t] &= kept_keys()[0, 0, -1]  # the kept rows, the last query's causal ones
        return mask

    with torch.no_grad():
        viewed = model(aux[:, KEPT], view_ids(ids), anchors, positions=KEPT[None])
        from_zero = model(aux[:, KEPT], view_ids(ids), anchors)
        monkeypatch.setattr(dflash_module, "block_attention_mask", kept_context)
        whole = model(aux, ids, KEPT[anchors])
    torch.testing.assert_close(viewed, whole)
    assert not torch.allclose(viewed[:, 1:], from_zero[:, 1:])


# ---- the seam ---------------------------------------------------------------------------------


def seam_batch(positions: torch.Tensor | None = KEPT[None]) -> Batch:
    torch.manual_seed(2)
    t, d = END, CONFIG.draft_vocab_size
    return Batch(
        aux=torch.zeros(1, t, 3 * CONFIG.target_hidden_size),
        input_ids=torch.randint(0, CONFIG.vocab_size, (1, t)),
        loss_mask=torch.ones(1, t, dtype=torch.bool),
        target_logits=torch.randn(1, t, d).log_softmax(-1),
        in_draft_vocab=torch.ones(1, t, dtype=torch.bool),
        samples=[],
        token_mask=torch.ones(1, t, dtype=torch.bool),
        positions=positions,
    )


def true_targets(offset: int) -> int:
    """Rows t whose row t + offset is its true position offset on (same span)."""
    return len(same_span(offset))


def test_ttt_loss_counts_no_target_across_the_seam():
    batch = seam_batch()
    logits = [torch.randn(1, END, CONFIG.draft_vocab_size) for _ in range(STEPS)]
    _, stats = ttt_loss(logits, batch, 0.8)
    assert stats.counted == [true_targets(1 + i) for i in range(STEPS)]
    _, unviewed = ttt_loss(logits, seam_batch(None), 0.8)
    assert unviewed.counted == [END - 1 - i for i in range(STEPS)]  # today's count, no seam
    # What a row across the seam predicts does not move the loss.
    changed = [x.clone() for x in logits]
    changed[0][0, SINK_END - 1] += 5.0
    assert ttt_loss(changed, batch, 0.8)[0] == ttt_loss(logits, batch, 0.8)[0]


def test_p_eagle_trains_no_depth_across_the_seam():
    valid = depth_valid(seam_batch(), STEPS)
    assert [int(v.sum()) for v in valid] == [true_targets(1 + d) for d in range(STEPS)]
    assert not valid[0][0, SINK_END - 1] and not valid[2][0, SINK_END - 3]


def test_dflash_anchors_and_slots_stop_at_the_seam():
    batch = seam_batch()
    anchors = select_anchors(batch.loss_mask, 4, positions=batch.positions)
    assert SINK_END - 1 not in anchors[0].tolist()  # its slot 1 would be the window's token
    # Nor the window's first row: it holds the token after the sink, not its own.
    assert SINK_END not in anchors[0].tolist()
    assert 2 in anchors[0].tolist() and SINK_END + 1 in anchors[0].tolist()
    _, valid = block_targets(batch, torch.tensor([[1, 2, SINK_END]]), 4)
    assert valid[0].tolist() == [
        [False, True, True, False],  # slot 3 of anchor 1 would be the window's first token
        [False, True, False, False],
        [False, True, True, True],
    ]
