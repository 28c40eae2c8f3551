"""What a resumed training run reads back, without a run of its own: a journal that is not plain
training state is moved aside unrun, the random state round-trips through a safe checkpoint, a
torn line of metrics.jsonl is dropped, and the aux noise is a function of seed and step only.
Training on the demo run's hidden states: tests/workflow/test_train.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch


@pytest.mark.slow  # as where it was, in tests/workflow/test_train.py
def test_aux_noise_is_bounded_and_a_function_of_seed_and_step():
    from eaglenest.drafter.batches import Batch
    from eaglenest.stages.train.feed import with_aux_noise

    def noised(seed: int, step: int, noise: float = 0.05) -> torch.Tensor:
        batch = Batch(torch.zeros(2, 5, 6), torch.zeros(2, 5, dtype=torch.long),
                      torch.ones(2, 5, dtype=torch.bool), None, None, [])  # fmt: skip
        return with_aux_noise(batch, noise, seed, step).aux

    first = noised(0, 7)
    assert first.abs().max() <= 0.05 and first.abs().max() > 0.04
    assert torch.equal(first, noised(0, 7))
    assert not torch.equal(first, noised(0, 8)) and not torch.equal(first, noised(1, 7))
    assert torch.equal(noised(0, 7, noise=0.0), torch.zeros(2, 5, 6))


class _Payload:
    """An object a pickle can name: loading it with weights_only=False would import and build it."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.slow  # as where it was, in tests/workflow/test_train.py
@pytest.mark.parametrize(
    "content",
    [
        pytest.param("payload", id="arbitrary-object"),
        pytest.param(b"not a checkpoint", id="garbage"),
        pytest.param("truncated", id="truncated"),
    ],
)
def test_a_journal_that_is_not_plain_training_state_is_moved_aside_unrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, content
):
    from eaglenest.stages.train.checkpoint import load_checkpoint

    monkeypatch.chdir(tmp_path)
    state = tmp_path / "journal" / "state.pt"
    state.parent.mkdir()
    if content == "payload":
        torch.save({"step": 3, "rng": [_Payload()]}, state)
    elif content == "truncated":
        torch.save({"step": 3, "model": {"w": torch.ones(1000)}}, state)
        state.write_bytes(state.read_bytes()[:500])
    else:
        state.write_bytes(content)
    with caplog.at_level("WARNING"):
        assert load_checkpoint(state, "cpu") is None
    assert not (tmp_path / "pwned").exists()
    assert not state.exists() and (state.parent / "state.pt.stale").exists()
    assert "not a readable training state" in caplog.text and str(state) in caplog.text
    assert load_checkpoint(state, "cpu") is None  # nothing to resume now


@pytest.mark.slow  # as where it was, in tests/workflow/test_train.py
def test_the_random_state_round_trips_through_a_safe_checkpoint(tmp_path: Path):
    import random

    import numpy as np

    from eaglenest.stages.train.checkpoint import load_checkpoint, rng_state, set_rng_state

    path = tmp_path / "state.pt"
    torch.save({"rng": [rng_state()]}, path)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(load_checkpoint(path, "cpu")["rng"][0])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0])
    assert np.array_equal(expected[1], again[1]) and expected[2] == again[2]


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path):
    from eaglenest.stages.train.checkpoint import MetricsLog

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"split": "train", "step": s, "loss": 1.0}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"split": "train", "step": 4, "lo')
    metrics = MetricsLog(path, keep_until_step=2)
    metrics.write({"split": "train", "step": 3, "loss": 0.5})
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert list(tmp_path.glob(".metrics.jsonl.*.tmp")) == []
