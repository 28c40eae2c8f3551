"""drafter{suffix}/train_report.json (the train stage → the report): what a training run did, as
a typed record (figure_fields.py: read back and written again key for key).

Every key the train stage writes is a field; the drafter's description and the settings it was
trained with are kept as the stage records them (open-ended objects the report walks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eaglenest.formats.figure_fields import Record, read_json_object, typed


@dataclass(frozen=True, kw_only=True)
class TrainReport(Record):
    """One family's training: its steps, accuracy per TTT step (train and held out), speed."""

    TOP: ClassVar[bool] = True
    # Written as null when None: no held-out shard, no held-out loss.
    ALWAYS: ClassVar[frozenset[str]] = frozenset({"heldout_loss"})

    steps: int = typed("int", required=True)
    ttt_steps: int = typed("int", required=True)  # the drafted slots scored
    train_acc: list[float] = typed("numbers", required=True)  # per TTT step, the last step's
    epochs: float | None = typed("number")
    family: str | None = typed("str")
    train_tokens: int | None = typed("int")
    wall_s: float | None = typed("number")
    tokens_per_s: float | None = typed("number")
    heldout_acc: list[float] | None = typed("numbers")
    heldout_loss: float | None = typed("number")
    heldout_positions: int | None = typed("int")
    skipped_outside_vocab_share: float | None = typed("number")
    data_wait_share: float | None = typed("number")  # of the wall time, waiting for batches
    eval_shards: list[str] | None = typed("strs")
    train_shards: list[str] | None = typed("strs")
    world_size: int | None = typed("int")
    device: str | None = typed("str")
    # train.sequence as trained: mode, length, sink, and tokens_trained (the samples' tokens
    # the batches held, padding aside, over every step and process).
    sequence: dict[str, Any] | None = typed("object")
    # The largest rotary position of a token in any training batch (a drafted slot rotates up to
    # K - 1 past its query's): what the drafter has seen, which a served length must not pass
    # unnoticed.
    max_position_trained: int | None = typed("int")
    drafter: dict[str, Any] | None = typed("object")  # the family's description of its model
    settings: dict[str, Any] | None = typed("object")  # the `train` section, as recorded

    @classmethod
    def from_json(cls, data: Any, where: str = "train_report.json") -> TrainReport:
        return super().from_json(data, where)

    @classmethod
    def read(cls, path: str | Path) -> TrainReport:
        return cls.from_json(read_json_object(path), str(path))
