"""The per-position losses (train.loss, train.target_outside_vocab) on small tensors against
values computed by hand, and the target signal they read (full-vocabulary log-probabilities)."""

from __future__ import annotations

import math

import pytest
import torch

from eaglenest.drafter.batches import Batch
from eaglenest.stages.train.loss import Objective, position_losses, ttt_loss

LN2, LN3 = math.log(2), math.log(3)

# One position, a draft vocabulary of 2 tokens. The drafter: logits (0, ln 2), so q = (1/3, 2/3).
# The target, over its full vocabulary: 0.3 and 0.2 on the two draft tokens, 0.5 outside.
LOGITS = torch.tensor([[[0.0, LN2]]], dtype=torch.float64)
TARGET = torch.tensor([[[math.log(0.3), math.log(0.2)]]], dtype=torch.float64)
VALID = torch.ones(1, 1, dtype=torch.bool)

# renormalised p = (0.6, 0.4); ignored: p = (0.3, 0.2).
EXPECTED = {
    ("cross_entropy", "renormalise"): 0.6 * LN3 + 0.4 * (LN3 - LN2),
    ("forward_kl", "renormalise"): 0.6 * LN3 + 0.4 * (LN3 - LN2)
    + 0.6 * math.log(0.6) + 0.4 * math.log(0.4),
    ("cross_entropy", "ignore"): 0.3 * LN3 + 0.2 * (LN3 - LN2),
    ("forward_kl", "ignore"): 0.3 * LN3 + 0.2 * (LN3 - LN2)
    + 0.3 * math.log(0.3) + 0.2 * math.log(0.2),
    # The target's argmax is draft token 0, q_0 = 1/3, whatever the mass outside.
    ("hard_cross_entropy", "renormalise"): LN3,
    ("hard_cross_entropy", "ignore"): LN3,
}  # fmt: skip


@pytest.mark.parametrize(("loss", "outside"), list(EXPECTED))
def test_each_loss_computes_its_hand_computed_value(loss, outside):
    value = position_losses(LOGITS, TARGET, VALID, Objective(loss, outside))
    assert value.shape == (1, 1)
    assert value.item() == pytest.approx(EXPECTED[loss, outside], rel=1e-12)


def test_a_perfect_drafter_has_zero_kl_and_the_targets_entropy_as_cross_entropy():
    p = torch.tensor([0.6, 0.4], dtype=torch.float64)
    logits = p.log()[None, None]
    renormalise = Objective("forward_kl", "renormalise")
    assert position_losses(logits, TARGET, VALID, renormalise).item() == pytest.approx(0, abs=1e-15)
    entropy = -(p * p.log()).sum().item()
    cross_entropy = position_losses(logits, TARGET, VALID, Objective("cross_entropy"))
    assert cross_entropy.item() == pytest.approx(entropy, rel=1e-12)


@pytest.mark.parametrize("outside", Objective.OUTSIDE_VOCAB)
def test_forward_kl_has_the_gradient_of_cross_entropy(outside):
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    target = torch.randn(2, 3, 5, dtype=torch.float64).log_softmax(-1) - 0.5  # mass outside
    valid = torch.tensor([[True, False, True], [True, True, False]])
    grads = []
    for loss in ("cross_entropy", "forward_kl"):
        x = logits.clone().requires_grad_()
        position_losses(x, target, valid, Objective(loss, outside)).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)
    assert grads[0][0, 1].abs().sum() == 0  # an invalid position pulls nothing


def test_ignoring_the_mass_outside_weighs_a_position_by_its_draft_share():
    """Same shape of p, half the draft share: half the loss and half the gradient."""
    torch.manual_seed(0)
    logits = torch.randn(1, 1, 4, dtype=torch.float64, requires_grad=True)
    inside = torch.tensor([[[0.5, 0.3, 0.1, 0.1]]], dtype=torch.float64)
    ignore = Objective("cross_entropy", "ignore")
    full = position_losses(logits, inside.log(), VALID, ignore)
    half = position_losses(logits, (inside / 2).log(), VALID, ignore)
    assert half.item() == pytest.approx(full.item() / 2, rel=1e-12)
    renormalised = position_losses(logits, (inside / 2).log(), VALID, Objective("cross_entropy"))
    assert renormalised.item() == pytest.approx(full.item(), rel=1e-12)


def test_a_topk_row_without_draft_tokens_gives_no_nan_behind_the_mask():
    logits = torch.zeros(1, 2, 3, dtype=torch.float64, requires_grad=True)
    target = torch.full((1, 2, 3), float("-inf"), dtype=torch.float64)
    target[0, 0] = torch.tensor([0.0, -1.0, -2.0])
    valid = torch.tensor([[True, False]])
    for loss in Objective.LOSSES:
        for outside in Objective.OUTSIDE_VOCAB:
            value = position_losses(logits, target, valid, Objective(loss, outside))
            value.sum().backward()
            assert torch.isfinite(value).all() and torch.isfinite(logits.grad).all()
            assert value[0, 1] == 0
            logits.grad = None


def test_unknown_options_are_named():
    with pytest.raises(ValueError, match="train.loss 'kl'"):
        Objective("kl")
    with pytest.raises(ValueError, match="train.target_outside_vocab 'drop'"):
        Objective("cross_entropy", "drop")
    with pytest.raises(ValueError, match="train.loss_positions 'prompt'"):
        Objective(loss_positions="prompt")


def test_loss_positions_count_the_completion_or_every_token_never_the_padding():
    """One sample of 4 tokens (prompt 0-1, completion 2-3) padded to 6. Step 0 at position t
    predicts token t + 1: completion counts t = 1, 2; all counts t = 0, 1, 2 (t = 3 is the last
    token, nothing after it; 4-5 are padding). Each position's hard loss is made distinct (its
    draft-token 0 logit is -t, the target's argmax is token 0), so the mean names the positions."""
    t, d = 6, 3
    logits = torch.zeros(1, t, d, dtype=torch.float64)
    logits[0, :, 0] = -torch.arange(t, dtype=torch.float64)
    target = torch.full((1, t, d), -5.0, dtype=torch.float64)
    target[..., 0] = -0.1
    loss_mask = torch.tensor([[False, False, True, True, False, False]])
    token_mask = torch.tensor([[True, True, True, True, False, False]])
    batch = Batch(torch.zeros(1, t, 6), torch.zeros(1, t, dtype=torch.long), loss_mask, target,
                  torch.ones(1, t, dtype=torch.bool), [], token_mask=token_mask)  # fmt: skip
    # ttt_loss compares position t's logits with the target at t + 1 (shift_left).
    shifted = torch.cat([target[:, 1:], target[:, :1]], dim=1)
    per_position = position_losses(logits, shifted, torch.ones(1, t, dtype=torch.bool),
                                   Objective("hard_cross_entropy"))[0]  # fmt: skip
    for positions, counted in (("completion", [1, 2]), ("all", [0, 1, 2])):
        loss, stats = ttt_loss([logits], batch, 0.8, objective=Objective(loss_positions=positions))
        assert stats.counted == [len(counted)]
        assert loss.item() == pytest.approx(per_position[counted].mean().item(), rel=1e-12)


def test_the_target_signal_is_full_vocabulary_log_probabilities():
    """Draft tokens' log-probabilities under the target's full softmax (exp sums to the draft
    share), from the final hidden state and from top-k logits (the k stored ones' softmax)."""
    from types import SimpleNamespace

    from eaglenest.drafter.batches import TargetSignal

    torch.manual_seed(0)
    vocab, hidden = 6, 4
    head = SimpleNamespace(lm_head=torch.randn(vocab, hidden))
    draft_ids = torch.tensor([1, 3, 4])
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    target_to_draft = torch.full((vocab,), -1)
    target_to_draft[draft_ids] = torch.arange(3)
    vocab_files = SimpleNamespace(draft_ids=draft_ids, t2d=t2d, target_to_draft=target_to_draft)
    signal = TargetSignal(head, vocab_files)
    final = torch.randn(5, hidden)
    logprobs, _ = signal.from_final_hidden(final)
    expected = (final @ head.lm_head.T).log_softmax(-1)[:, draft_ids]
    torch.testing.assert_close(logprobs, expected)
    assert (logprobs.exp().sum(-1) < 1).all()
    top = torch.topk(final @ head.lm_head.T, 4)
    logprobs, _ = signal.from_topk(top.indices, top.values)
    kept = top.values.log_softmax(-1)
    for row in range(5):
        for j, token in enumerate(top.indices[row].tolist()):
            if t2d[token]:
                assert logprobs[row, int(target_to_draft[token])] == pytest.approx(kept[row, j])


def test_the_hard_loss_reads_only_the_argmax_so_every_top_k_trains_alike():
    """With hard_cross_entropy the stored top-k (any k >= 1) gives the loss of the full final
    hidden state: why experiments/storage.py measures the same drafter for top-32, 16 and 8."""
    from types import SimpleNamespace

    from eaglenest.drafter.batches import TargetSignal

    torch.manual_seed(1)
    vocab, hidden, rows = 8, 4, 64
    head = SimpleNamespace(lm_head=torch.randn(vocab, hidden))
    draft_ids = torch.tensor([0, 2, 3, 5, 6])
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    target_to_draft = torch.full((vocab,), -1)
    target_to_draft[draft_ids] = torch.arange(len(draft_ids))
    signal = TargetSignal(head, SimpleNamespace(draft_ids=draft_ids, t2d=t2d,
                                                target_to_draft=target_to_draft))  # fmt: skip
    final = torch.randn(rows, hidden)
    drafter_logits = torch.randn(1, rows, len(draft_ids))
    hard, soft = Objective("hard_cross_entropy"), Objective("cross_entropy")

    def losses(logprobs: torch.Tensor, in_vocab: torch.Tensor, objective: Objective):
        return position_losses(drafter_logits, logprobs[None], in_vocab[None], objective)

    full, full_in = signal.from_final_hidden(final)
    assert 0 < int(full_in.sum()) < rows  # some argmaxes outside the draft vocabulary
    for k in (1, 2, 6):
        top = torch.topk(final @ head.lm_head.T, k)
        logprobs, in_vocab = signal.from_topk(top.indices, top.values)
        assert torch.equal(in_vocab, full_in)
        torch.testing.assert_close(losses(logprobs, in_vocab, hard), losses(full, full_in, hard))
    # The soft loss does see k: top-2 renormalises over two tokens only.
    top = torch.topk(final @ head.lm_head.T, 2)
    logprobs, in_vocab = signal.from_topk(top.indices, top.values)
    assert not torch.allclose(losses(logprobs, in_vocab, soft), losses(full, full_in, soft))
