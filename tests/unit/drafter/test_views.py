"""train.sequence's views (eaglenest.drafter.views) and the batches that read them
(eaglenest.drafter.batches): the peers' head cut, our sink + window at true positions, drawn anew
each epoch and the same after a resume, samples no longer than `length` read as today, batches
formed by the viewed lengths, packed rows too."""

from __future__ import annotations

import pytest
import torch
from support.synthetic_run import write_synthetic_run

from eaglenest.drafter.batches import BatchPlan, batch_positions, build_batch, build_packed_batch
from eaglenest.drafter.views import (
    SampleView,
    continues,
    sample_view,
    viewed_length,
    window_draws,
)
from eaglenest.formats.hidden_shard import open_hidden_shard
from eaglenest.settings.train import SequenceSettings

WINDOWS = SequenceSettings("windows", 16, "prompt")
HEAD = SequenceSettings("head", 16, "prompt")
WHOLE = SequenceSettings("whole", 16, "prompt")


def test_a_sample_no_longer_than_length_has_no_view_in_any_mode():
    for sequence in (WINDOWS, HEAD, WHOLE, None):
        assert sample_view(sequence, 16, 5, draw=123) is None
        assert viewed_length(sequence, 16) == 16
    assert sample_view(WHOLE, 400, 5, draw=123) is None
    assert viewed_length(WHOLE, 400) == 400 and viewed_length(HEAD, 400) == 16


def test_head_keeps_the_first_length_tokens_from_position_0():
    view = sample_view(HEAD, 100, 5, draw=77)
    assert view == SampleView(0, 0, 16)
    assert view.positions().tolist() == list(range(16))


def test_windows_keep_the_prompt_then_a_window_in_the_answer_at_true_positions():
    starts = set()
    for draw in range(200):
        view = sample_view(WINDOWS, 100, 5, draw)
        assert view.sink == 5 and view.length == 16
        assert 5 <= view.start <= 100 - 11 and view.stop == view.start + 11
        assert view.positions().tolist() == [*range(5), *range(view.start, view.stop)]
        starts.add(view.start)
    assert starts == set(range(5, 90))  # every start in the answer is drawn


def test_the_prompt_sink_is_capped_so_the_window_keeps_half():
    view = sample_view(WINDOWS, 100, 60, draw=0)
    assert view.sink == 8 and view.stop - view.start == 8
    assert view.start >= 60  # the window still starts in the answer
    # A count of first tokens: that many, the window from the answer on.
    fixed = sample_view(SequenceSettings("windows", 16, 3), 100, 10, draw=0)
    assert fixed == SampleView(3, 10, 23)
    alone = sample_view(SequenceSettings("windows", 16, 0), 100, 10, draw=5)
    assert alone.sink == 0 and alone.positions().tolist() == list(range(15, 31))


def test_a_window_that_cannot_start_in_the_answer_ends_with_the_sample():
    view = sample_view(WINDOWS, 20, 8, draw=9)  # the answer's 12 tokens: the window takes 8
    assert view == SampleView(8, 12, 20)


def test_draws_are_a_function_of_seed_and_epoch_and_change_every_epoch():
    first = window_draws(3, 0, 50)
    assert (first == window_draws(3, 0, 50)).all()
    assert (first != window_draws(3, 1, 50)).mean() > 0.9
    assert (first != window_draws(4, 0, 50)).mean() > 0.9


def test_continues_marks_only_true_next_positions():
    positions = torch.tensor([[0, 1, 2, 7, 8, 9], [0, 1, 0, 1, 2, 0]])
    assert continues(positions, 1).tolist() == [
        [True, True, False, True, True, False],
        [True, False, True, True, False, False],
    ]
    assert continues(positions, 2).tolist()[0] == [True, False, False, True, False, False]


# ---- the batches ---------------------------------------------------------------------------

SIZE = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "num_hidden_layers": 8, "vocab_size": 64,
        "draft_vocab_size": 16, "lengths": (10, 60)}  # fmt: skip


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    run = write_synthetic_run(tmp_path_factory.mktemp("views"), SIZE, samples=24, shards=2)
    return [open_hidden_shard(p) for p in run["train_shards"]]


def rows_at(shards, sample, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sample's tokens and target states (final hidden) at these positions."""
    shard, index = sample
    whole = next(s for s in shards if s.path.name == shard).sample(index)
    return whole["input_ids"][positions], whole["final_hidden"][positions]


@pytest.mark.parametrize("sequence", [HEAD, WINDOWS])
def test_a_batch_reads_each_samples_view_at_its_positions(shards, sequence):
    plan = BatchPlan(shards, 64, seed=0, sequence=sequence)
    assert max(ref.length for ref in plan.refs) == 16  # batches formed by the viewed lengths
    assert all(sum(r.length for r in b) <= 64 for b in plan.epoch_order(0))
    viewed = 0
    for refs in plan.epoch_order(0):
        batch = build_batch(refs, shards, None, sequence)
        positions = batch_positions(batch)
        for row, ref in enumerate(refs):
            n = ref.length
            kept = positions[row, :n]
            ids, states = rows_at(shards, batch.samples[row], kept)
            torch.testing.assert_close(batch.final_hidden[row, :n], states.float())
            seam = [u for u in range(1, n) if kept[u] != kept[u - 1] + 1]
            if seam:  # the window's first row holds the token after the sink (views.py)
                (u,) = seam
                ids[u] = rows_at(shards, batch.samples[row], torch.tensor([u]))[0][0]
            torch.testing.assert_close(batch.input_ids[row, :n], ids)
            shard = shards[ref.shard]
            full = int(shard.offsets[ref.index + 1] - shard.offsets[ref.index])
            if full <= 16:
                assert kept.tolist() == list(range(n))  # as today
                continue
            viewed += 1
            prompt = shard.prompt_len(ref.index)
            if sequence.mode == "head":
                assert kept.tolist() == list(range(16))
            else:
                sink = min(prompt, 8)
                assert kept[:sink].tolist() == list(range(sink))
                assert kept[sink] >= prompt  # the window lies in the answer
                assert (kept[sink:].diff() == 1).all()
    assert viewed > 10


def test_windows_are_the_same_after_a_resume_and_new_each_epoch(shards):
    def windows(epoch: int) -> dict:
        plan = BatchPlan(shards, 64, seed=5, sequence=WINDOWS)  # a new plan: a resumed run
        out = {}
        for refs in plan.epoch_order(epoch):
            batch = build_batch(refs, shards, None, WINDOWS)
            for row, sample in enumerate(batch.samples):
                out[sample] = batch_positions(batch)[row, : refs[row].length].tolist()
        return out

    first = windows(0)
    assert first == windows(0)
    again = windows(1)
    moved = [s for s in first if first[s] != again[s]]
    assert len(moved) >= len([s for s in first if first[s] != list(range(16))]) // 2
    assert moved


def test_packed_rows_keep_each_samples_positions(shards):
    """A windowed sample fills its row (rows are as long as the longest sample); shorter ones
    beside it pack into rows whose positions restart at each sample."""
    sequence = SequenceSettings("windows", 24, "prompt")
    plan = BatchPlan(shards, 96, seed=0, packed=True, sequence=sequence)
    for epoch in range(4):
        for refs in plan.epoch_order(epoch):
            alone = build_batch(refs, shards, None, sequence)
            packed = build_packed_batch(refs, shards, 96, None, sequence)
            if packed.segments is None or packed.positions is None:
                continue
            expect = {
                sample: alone.positions[r, : refs[r].length].tolist()
                for r, sample in enumerate(alone.samples)
            }
            order, found = iter(packed.samples), {}
            for row in range(packed.segments.shape[0]):
                for s in range(int(packed.segments[row].max()) + 1):
                    found[next(order)] = packed.positions[row][packed.segments[row] == s].tolist()
            assert found == expect
            assert max(len(p) for p in found.values()) == 24
            assert any(p[-1] >= 24 for p in found.values())  # a window past the head
            return
    pytest.fail("no batch packed a windowed sample beside another")
