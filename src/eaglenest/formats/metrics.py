"""eval{suffix}/metrics.json (the evaluate stage → the report) and eval_compare/{name}.json
(evaluate_compare → the report): the acceptance figures of a drafter, as typed records.

Acceptance length = 1 + accepted draft tokens per verification round. Per K (a string key, as
JSON has it): the simulated figures (`SimulatedFigures`, and the baselines'), the live loop's
(`LiveFigures`), the serving engine's (`EngineFigures` in an `EngineRun`, greedy and `sampled`),
and by generated depth (`DepthTable`). The standard sets' and the thinking modes' figures are kept
as the stage writes them (`sets`, `thinking`: open-ended tables the report walks).

Each record reads its JSON object with `from_json(data, where)` (every typed key checked: an
error names the file and the key) and writes it back with `to_json()`, key for key
(figure_fields.py). `emitted_per_round` is the one definition of emitted tokens per round.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eaglenest.formats.figure_fields import (
    FigureFileError,
    Nested,
    Record,
    nested_by_key,
    read_json_object,
    record_of,
    records_by_key,
    typed,
)


def emitted_per_round(tokens: int | None, prompts: int | None, rounds: int | None) -> float | None:
    """Tokens kept per verification round: all tokens less the one per prompt the prefill emits,
    over the rounds (None without rounds). One definition for the engine and for our live loop,
    counting only tokens the answer kept (vLLM's own counters, 1 + accepted / drafts, also count
    drafts accepted past the end of an answer)."""
    if not rounds or tokens is None or prompts is None:
        return None
    return (tokens - prompts) / rounds


def recorded_or_emitted(figures: dict[str, Any]) -> float | None:
    """A figure's emitted tokens per round: as recorded, else from its tokens, prompts, rounds."""
    if figures.get("emitted_per_round") is not None:
        return figures["emitted_per_round"]
    return emitted_of(figures)


def emitted_of(figures: dict[str, Any]) -> float | None:
    """`emitted_per_round` of a figure's tokens, prompts and rounds (None where one is missing)."""
    return emitted_per_round(*(figures.get(key) for key in ("tokens", "prompts", "rounds")))


# ---------------------------------------------------------------------------------------------
# Per K
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SimulatedFigures(Record):
    """One K's simulated acceptance (and each baseline's): from stored features."""

    acceptance_length: float = typed("number", required=True)
    # Per draft step: of the chains that reached it, the share it matched.
    conditional_acceptance: list[float] = typed("numbers", required=True)
    positions: int | None = typed("int")  # the positions a chain started at
    cut_by_sampling: int | None = typed("int")  # accepted drafts past a sampled data token


@dataclass(frozen=True, kw_only=True)
class DecodedFigures(Record):
    """One K's figures of a real decoding (the live loop's, or a depth row's measurement)."""

    emitted_per_round: float | None = typed("number")
    # The round's time, the drafter's and the target's, and the target's plain greedy step.
    drafter_s_per_round: float | None = typed("number")
    target_s_per_round: float | None = typed("number")
    greedy_s_per_token: float | None = typed("number")
    target_forwards_per_token: float | None = typed("number")
    speedup: float | None = typed("number")
    tokens: int | None = typed("int")
    prompts: int | None = typed("int")
    identical_to_greedy: bool | None = typed("bool")
    spec_wall_s: float | None = typed("number")
    greedy_wall_s: float | None = typed("number")

    def emitted(self) -> float | None:
        """Emitted tokens per round: as recorded."""
        return self.emitted_per_round


@dataclass(frozen=True, kw_only=True)
class LiveFigures(DecodedFigures):
    """One K's live figures: greedy speculative decoding with the transformers target."""

    # Every key, written as null when None (no rounds: no emitted_per_round; no plain greedy
    # step after the prefill: no greedy_s_per_token).
    ALWAYS: ClassVar[frozenset[str]] = frozenset(
        [
            "acceptance_length",
            "emitted_per_round",
            "rounds",
            "rounds_per_prompt",
            "drafter_s_per_round",
            "target_s_per_round",
            "greedy_s_per_token",
            "per_position_acceptance",
            "accepted_per_position",
            "drafted_per_position",
            "target_forwards_per_token",
            "speedup",
            "tokens",
            "prompts",
            "identical_to_greedy",
            "spec_wall_s",
            "greedy_wall_s",
            "greedy_tokens",
        ]
    )

    acceptance_length: float = typed("number", required=True)
    rounds: int | None = typed("int")
    rounds_per_prompt: list[int] | None = typed("numbers")  # to compare with the engine's
    per_prompt: list[float | None] | None = typed("any")  # each prompt's acceptance length
    # Accepted at draft position i / drafted at i, and the two counts.
    per_position_acceptance: list[float] | None = typed("numbers")
    accepted_per_position: list[int] | None = typed("numbers")
    drafted_per_position: list[int] | None = typed("numbers")
    greedy_tokens: int | None = typed("int")


@dataclass(frozen=True, kw_only=True)
class EngineFigures(Record):
    """One K's figures in the serving engine (vLLM's counters), greedy or sampled."""

    # The keys of every engine figure (vllm_evaluate.acceptance), written as null when None
    # (an answer without a per-prompt count of rounds: rounds_per_prompt, emitted_per_prompt);
    # the temperature, set, spread and record by position are added where measured.
    ALWAYS: ClassVar[frozenset[str]] = frozenset(
        [
            "acceptance_length",
            "rounds",
            "rounds_per_prompt",
            "emitted_per_prompt",
            "per_position_acceptance",
            "accepted_per_position",
            "drafted_per_position",
            "draft_tokens",
            "accepted_tokens",
            "tokens",
            "prompts",
            "identical_to_plain",
            "spec_wall_s",
            "plain_wall_s",
            "speedup",
        ]
    )

    acceptance_length: float = typed("number", required=True)  # 1 + accepted / drafts
    rounds: int | None = typed("int")  # drafts
    rounds_per_prompt: list[int] | None = typed("any")
    # Per prompt: the tokens its answer kept past the one the prefill emits (with
    # rounds_per_prompt, the report's bootstrap over prompts of emitted tokens per round).
    emitted_per_prompt: list[int] | None = typed("any")
    per_position_acceptance: list[float] | None = typed("numbers")
    accepted_per_position: list[int] | None = typed("any")
    drafted_per_position: list[int] | None = typed("any")
    draft_tokens: int | None = typed("any")
    accepted_tokens: int | None = typed("any")
    tokens: int | None = typed("int")
    prompts: int | None = typed("any")
    identical_to_plain: bool | None = typed("any")  # None for a sampled answer
    spec_wall_s: float | None = typed("any")
    plain_wall_s: float | None = typed("any")
    speedup: float | None = typed("any")
    temperature: float | None = typed("number")
    spread: dict[str, Any] | None = typed("object")  # over prompts (evaluate/spread.py)
    by_position: dict[str, Any] | None = typed("object")  # by generated position

    def emitted(self) -> float | None:
        """Emitted tokens per round on `emitted_per_round`'s definition."""
        return emitted_per_round(self.tokens, self.prompts, self.rounds)


@dataclass(frozen=True, kw_only=True)
class EngineRun(Record):
    """metrics.json `engine` (and its `sampled`): the serving engine's figures per K; its depth
    cuts, sets, plain decoding and reasons for a K not served kept as written."""

    engine: str | None = typed("str")
    per_k: dict[str, EngineFigures] | None = typed("object", nested=records_by_key(EngineFigures))
    # The same figures sampled at the generation temperature (its settings kept as written).
    sampled: EngineRun | None = typed("object", nested=record_of(lambda: EngineRun))


# ---------------------------------------------------------------------------------------------
# By depth
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DepthLiveFigures(DecodedFigures):
    """A depth row's live figures: the acceptance, rounds and times of one K there."""

    ALWAYS: ClassVar[frozenset[str]] = frozenset(
        [
            "acceptance_length",
            "emitted_per_round",
            "rounds",
            "tokens",
            "prompts",
            "identical_to_greedy",
            "drafter_s_per_round",
            "target_s_per_round",
            "greedy_s_per_token",
        ]
    )

    acceptance_length: float | None = typed("any")
    rounds: int | None = typed("any")
    # Each prompt's acceptance length (None: no round) and rounds, where the loop kept them:
    # what the report's interval by depth is drawn from (report/depth_health.py).
    per_prompt: list[float | None] | None = typed("any")
    rounds_per_prompt: list[int] | None = typed("any")


@dataclass(frozen=True, kw_only=True)
class DepthEngineFigures(DecodedFigures):
    """A depth row's engine figures (greedy, or sampled): with the temperature and the 95%
    interval of the acceptance length over prompts, where measured."""

    ALWAYS: ClassVar[frozenset[str]] = frozenset(
        [
            "acceptance_length",
            "emitted_per_round",
            "rounds",
            "tokens",
            "prompts",
            "identical_to_plain",
            "temperature",
            "ci95",
        ]
    )

    acceptance_length: float | None = typed("any")
    rounds: int | None = typed("any")
    identical_to_plain: bool | None = typed("any")
    temperature: float | None = typed("any")
    ci95: list[float] | None = typed("any")
    # Each prompt's rounds and emitted tokens (past the prefill's one), where the engine kept them:
    # what the report's choice bootstraps over at each depth (report/device_acceptance.py).
    rounds_per_prompt: list[int] | None = typed("any")
    emitted_per_prompt: list[int] | None = typed("any")
    # Each prompt's acceptance length, 1 + accepted / steps (the spread's, spread.py).
    per_prompt: list[float | None] | None = typed("any")


@dataclass(frozen=True, kw_only=True)
class DepthRow(Record):
    """One depth's row of one K: the prompts decoded there and each measurement's figures."""

    ALWAYS: ClassVar[frozenset[str]] = frozenset(
        ["prompts", "simulated", "live", "engine", "engine_sampled"]
    )

    depth: int = typed("int", required=True)
    prompts: int | None = typed("int")
    simulated: dict[str, Any] | None = typed("any")  # acceptance_length, positions
    live: DepthLiveFigures | None = typed("object", nested=record_of(DepthLiveFigures))
    engine: DepthEngineFigures | None = typed("object", nested=record_of(DepthEngineFigures))
    engine_sampled: DepthEngineFigures | None = typed(
        "object", nested=record_of(DepthEngineFigures)
    )


def _load_rows(value: dict[str, Any], where: str) -> dict[str, list[DepthRow]]:
    rows_by_k = {}
    for k, rows in value.items():
        if not isinstance(rows, list):
            raise FigureFileError(f"{where}[{k}]: expected a list of depth rows")
        rows_by_k[k] = [DepthRow.from_json(row, f"{where}[{k}][{i}]") for i, row in enumerate(rows)]
    return rows_by_k


DEPTH_ROWS = Nested(
    _load_rows, lambda value: {k: [row.to_json() for row in rows] for k, rows in value.items()}
)


@dataclass(frozen=True, kw_only=True)
class DepthTable(Record):
    """metrics.json `by_depth`: per K, a row per depth (evaluate/depths.py)."""

    depths: list[int] | None = typed("any")
    continuation_tokens: int | None = typed("any")
    samples: dict[str, dict[str, int]] | None = typed("any")  # per depth: the cut's counts
    per_k: dict[str, list[DepthRow]] | None = typed("object", nested=DEPTH_ROWS)
    definition: str | None = typed("any")


# ---------------------------------------------------------------------------------------------
# Both thinking modes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ThinkingFigures(Record):
    """metrics.json `thinking` (evaluate/thinking.py): the mode the drafter was trained in, the
    held-out prompts' mode and the other one, and the figures in each (`modes`: mode -> its
    prompts and the live, engine and sampled figures per K) with the other mode's over the
    generated mode's acceptance length (`other_vs_generated`: live, engine -> K -> ratio)."""

    # Every key, written as null when None (a template without a switch: no other mode).
    ALWAYS: ClassVar[frozenset[str]] = frozenset(
        [
            "trained",
            "heldout_mode",
            "other_mode",
            "switch",
            "other_prompts",
            "not_flipped",
            "skipped",
            "modes",
            "other_vs_generated",
        ]
    )

    trained: dict[str, Any] | None = typed("object")  # its mode, and its samples per mode
    heldout_mode: str | None = typed("str")  # "on" or "off"
    other_mode: str | None = typed("str")
    switch: str | None = typed("str")  # the chat template's key
    other_prompts: int | None = typed("int")
    not_flipped: int | None = typed("int")  # held-out prompts in neither mode
    skipped: str | None = typed("str")  # why there is no other mode
    modes: dict[str, dict[str, Any]] | None = typed("object")
    other_vs_generated: dict[str, dict[str, float | None] | None] | None = typed("object")


# ---------------------------------------------------------------------------------------------
# The files
# ---------------------------------------------------------------------------------------------

DEFINITION = "acceptance length = 1 + accepted draft tokens per verification round"


def live_over_simulated(
    live: dict[str, LiveFigures], simulated: dict[str, SimulatedFigures]
) -> dict[str, float]:
    """Per K live: the live acceptance length over the simulated one."""
    return {k: each.acceptance_length / simulated[k].acceptance_length for k, each in live.items()}


def by_k(cls: type, figures: dict[str, dict[str, Any]], where: str) -> dict[str, Any]:
    """Per-K figures (K -> a figure's JSON object) as `cls` records."""
    return {k: cls.from_json(each, f"{where}[{k}]") for k, each in figures.items()}


BY_NAME_SIMULATED = nested_by_key(records_by_key(SimulatedFigures))
BY_NAME_LIVE = nested_by_key(records_by_key(LiveFigures))


@dataclass(frozen=True, kw_only=True)
class EvalMetrics(Record):
    """eval{suffix}/metrics.json: one drafter family's figures at the K it serves."""

    TOP: ClassVar[bool] = True
    # Written as null when None (the stage's frame: the live figures may be skipped).
    ALWAYS: ClassVar[frozenset[str]] = frozenset({"live", "live_baselines", "live_skipped_reason"})

    ks: list[int] = typed("numbers", required=True)  # the Ks measured: those the family serves
    configured_ks: list[int] | None = typed("numbers")  # evaluate.ks
    served_ks: str | None = typed("str")  # why `ks` is what it is
    heldout_shards: list[str] | None = typed("strs")
    definition: str | None = typed("str")
    simulated: dict[str, SimulatedFigures] = typed(
        "object", required=True, nested=records_by_key(SimulatedFigures)
    )
    live: dict[str, LiveFigures] | None = typed("object", nested=records_by_key(LiveFigures))
    live_skipped_reason: str | None = typed("str")
    baselines: dict[str, dict[str, SimulatedFigures]] | None = typed(
        "object", nested=BY_NAME_SIMULATED
    )
    live_baselines: dict[str, dict[str, LiveFigures]] | None = typed("object", nested=BY_NAME_LIVE)
    engine: EngineRun | None = typed("object", nested=record_of(EngineRun))
    by_depth: DepthTable | None = typed("object", nested=record_of(DepthTable))
    family: str | None = typed("any")
    live_vs_simulated: dict[str, float] | None = typed("object")  # per K
    live_vs_engine: dict[str, float | None] | None = typed("object")  # per K, emitted per round
    sets: dict[str, Any] | None = typed("any")  # per set: its tables (evaluate/sets.py)
    thinking: ThinkingFigures | None = typed("object", nested=record_of(ThinkingFigures))
    # The served check's findings ({severity, key, message}: drafter/served_check.py) that did
    # not stop the evaluation; None: not checked (evaluate.served_check off).
    served_check: list[dict[str, str]] | None = typed("any")
    wall_s: float | None = typed("number")

    @classmethod
    def from_json(cls, data: Any, where: str = "metrics.json") -> EvalMetrics:
        metrics = super().from_json(data, where)
        for k in metrics.ks:
            if str(k) not in metrics.simulated:
                raise FigureFileError(f"{where}: 'simulated' has no entry for K={k}")
        return metrics

    @classmethod
    def read(cls, path: str | Path) -> EvalMetrics:
        return cls.from_json(read_json_object(path), str(path))

    def k_keys(self) -> list[str]:
        """The Ks measured, as the per-K tables key them."""
        return [str(k) for k in self.ks]

    def live_over_simulated(self) -> dict[str, float]:
        """Per K live: the live acceptance length over the simulated one (`live_vs_simulated`)."""
        return live_over_simulated(self.live or {}, self.simulated)


@dataclass(frozen=True, kw_only=True)
class CompareMetrics(Record):
    """eval_compare/{name}.json: a drafter trained elsewhere, decoded in vLLM at the run's K."""

    TOP: ClassVar[bool] = True

    name: str | None = typed("str")
    drafter: str | None = typed("str")  # its directory
    described: str | None = typed("str")  # what its config.json said
    method: dict[str, Any] | None = typed("object")  # vLLM's speculative method for it
    ks: list[int] | None = typed("numbers")
    engine: EngineRun | None = typed("object", nested=record_of(EngineRun))
    sets: dict[str, Any] | None = typed("any")
    wall_s: float | None = typed("number")

    @classmethod
    def read(cls, path: str | Path) -> CompareMetrics:
        return cls.from_json(read_json_object(path), str(path))
