"""train.sequence's settings: the schema's defaults (windows of 8,192 tokens after the prompt),
a JSON round trip as the training job reads them, and what is refused naming the key."""

from __future__ import annotations

import pytest

from eaglenest.common.config import ConfigError, validate_config
from eaglenest.settings.train import SequenceSettings, TrainSettings


def test_the_default_is_windows_of_8192_after_the_prompt_and_round_trips():
    settings = TrainSettings.from_config(validate_config({}))
    assert settings.sequence == SequenceSettings("windows", 8192, "prompt")
    assert settings.sequence.has_sink
    assert TrainSettings.from_json(settings.to_json()) == settings
    assert settings.recorded()["sequence"] == {"mode": "windows", "length": 8192, "sink": "prompt"}
    head = TrainSettings.from_config(validate_config({"train": {"sequence": {"mode": "head"}}}))
    assert not head.sequence.has_sink and TrainSettings.from_json(head.to_json()) == head
    counted = {"train": {"sequence": {"sink": 64}}}
    assert TrainSettings.from_config(validate_config(counted)).sequence.sink == 64


@pytest.mark.parametrize(
    ("sequence", "words"),
    [
        ({"mode": "tail"}, "train.sequence.mode"),
        ({"sink": "start"}, "train.sequence.sink"),
        ({"sink": -1}, "train.sequence.sink"),
        ({"length": 1}, "train.sequence.length"),
        ({"length": 64, "sink": 64}, "below train.sequence.length"),
    ],
)
def test_a_sequence_that_cannot_train_is_refused_naming_the_key(sequence, words):
    with pytest.raises(ConfigError, match=words):
        validate_config({"train": {"sequence": sequence}})
