"""`eaglenest plan`: what a config will cost before any of it runs: shards and jobs per stage, disk
per stage and in total for each `hidden.store` mode, and hours per stage from per-token rates.

    eaglenest plan --configfile config/examples/kimi-k2.5.yaml --set prompts.max_samples=500000

Nothing is read but the config (and the target's config.json when it is on disk, for its hidden
size): no data, no server. What is not in the config is assumed and printed as such:
- tokens per sample: half of `generation.max_tokens` (answers stop before the cap), or
  `--tokens-per-sample`;
- bytes per token of the raw, samples and tokens files, and the rates, measured on the demo here
  (DEMO_RATES, DEMO_BYTES_PER_TOKEN: a finished run's benchmarks/ and files, `rates_from_run`);
  the rates are for two CPU cores, so give a GPU cluster's own: `--generate-tokens-per-s` (per
  endpoint, all its concurrent requests), `--capture-tokens-per-s` (per capture engine),
  `--train-tokens-per-s` (per training process, i.e. per GPU).
The hidden states' bytes per token are exact: the shard layout of formats/hidden_shard.py.
Disk is per stored token (whole answers are captured and stored); training reads of each sample
what `train.sequence` keeps (at most `length` tokens in head and windows), so its hours follow
the tokens an epoch reads under the recipe (`epoch_train_tokens`), not the stored ones.

`hidden.store` (files: every state stored, today's pipeline; none: none stored, training asks the
capture servers for each batch every epoch; budget: the shards that fit in `hidden.cache_gb`
stored, the rest captured every epoch) is planned for all three modes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from eaglenest.run.plan_rates import rates_from_run
from eaglenest.run.plan_text import format_plan
from eaglenest.run.planning_cost import planning_notes
from eaglenest.run.shards import shard_bounds
from eaglenest.run.split import ShardSplit, budget_notes, split_shards
from eaglenest.run.store import hidden_bytes_per_token
from eaglenest.settings.hidden_states import STORE_MODES

# Measured by rates_from_run on a finished small demo run here (config/tests/demo-small.yaml: the
# embedded demo server generating, the transformers capture, 2 epochs of training) on the shared
# two-core machine under load: whole jobs (start-up included) of a tiny run, so they only size
# the demo itself; a cluster passes its own (docs/cluster.md).
DEMO_RATES = {
    "generate_tokens_per_s": 11.9,
    "capture_tokens_per_s": 126.0,
    "train_tokens_per_s": 65.0,
}
# Bytes per token of the files every shard keeps besides its hidden states (same run).
DEMO_BYTES_PER_TOKEN = {"raw": 10.5, "samples": 7.6, "tokens": 3.1}
DEFAULT_CACHE_GB = 1000.0  # budget mode, when the config has no hidden.cache_gb yet


@dataclass(frozen=True)
class Rates:
    generate_tokens_per_s: float  # per endpoint
    capture_tokens_per_s: float  # per capture engine (server, or shard job's own)
    train_tokens_per_s: float  # per training process (GPU)


@dataclass(frozen=True)
class Assumptions:
    tokens_per_sample: float
    hidden_size: int
    rates: Rates
    cache_gb: float


@dataclass(frozen=True)
class StageRow:
    stage: str
    jobs: dict[str, int]  # rule -> jobs
    shards: int
    disk_bytes: float
    hours: float | None
    note: str = ""


@dataclass(frozen=True)
class StoreRow:
    mode: str
    extract_jobs: int
    stored_shards: int
    hidden_bytes: float
    total_bytes: float
    capture_hours: float  # engine time over the whole training, epochs included


@dataclass(frozen=True)
class RunPlan:
    run: str
    samples: int
    shard_size: int
    train_shards: int
    eval_shards: int
    tokens: float
    train_tokens_per_epoch: float  # what training reads an epoch under train.sequence
    hidden_bytes_per_token: int
    assumptions: Assumptions
    stages: list[StageRow]
    stores: list[StoreRow]
    notes: list[str]

    @property
    def shards(self) -> int:
        return self.train_shards + self.eval_shards


@dataclass(frozen=True)
class Scale:
    """What the hours divide by: endpoints, capture engines, training processes."""

    endpoints: int
    capture_servers: int  # 0: no capture server (an engine per shard job, or transformers)
    processes: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> Scale:
        from eaglenest.settings.vllm import capture_urls

        vllm_backend = config["hidden"]["backend"] == "vllm"
        return cls(
            endpoints=1 if config["server"]["enabled"] else max(1, len(config["endpoints"])),
            capture_servers=len(capture_urls(config["vllm"])) if vllm_backend else 0,
            processes=config["train"]["gpus"] * config["train"].get("nodes", 1),
        )


def hours(n_tokens: float, tokens_per_s: float, parallel: int) -> float:
    return n_tokens / (tokens_per_s * max(1, parallel)) / 3600


def viewed_tokens_per_sample(config: dict[str, Any], tokens_per_sample: float) -> float:
    """Tokens of a sample a training step reads under train.sequence (whole: all of them)."""
    sequence = config["train"]["sequence"]
    if sequence["mode"] == "whole":
        return tokens_per_sample
    return min(tokens_per_sample, sequence["length"])


def sequence_label(config: dict[str, Any]) -> str:
    """train.sequence in the train row's words."""
    sequence = config["train"]["sequence"]
    if sequence["mode"] == "whole":
        return "whole samples"
    return f"{sequence['mode']} of {sequence['length']:,} tokens a sample"


def epoch_train_tokens(
    config: dict[str, Any], assumptions: Assumptions, split: ShardSplit
) -> float:
    """Tokens a training epoch reads: the training shards' samples, each as train.sequence
    views it."""
    samples = sum(len(range(*shard_bounds(config, s))) for s in split.training)
    return samples * viewed_tokens_per_sample(config, assumptions.tokens_per_sample)


def plan_run(config: dict[str, Any], assumptions: Assumptions) -> RunPlan:
    """The plan of a validated config (schema defaults filled in)."""
    prompts = config["prompts"]
    splits = {
        mode: split_shards(config, mode, assumptions.cache_gb, assumptions.hidden_size, warn=False)
        for mode in STORE_MODES
    }
    split = splits[config["hidden"]["store"]]
    tokens = prompts["max_samples"] * assumptions.tokens_per_sample
    per_token = hidden_bytes_per_token(config, assumptions.hidden_size)
    scale = Scale.of(config)
    stages = stage_rows(config, assumptions, scale, split, tokens, per_token)
    other_bytes = sum(row.disk_bytes for row in stages if row.stage != "hidden")
    engines = max(1, scale.capture_servers)
    stores = [
        store_row(mode, splits[mode], tokens, per_token, other_bytes, config, assumptions, engines)
        for mode in STORE_MODES
    ]
    return RunPlan(
        run=config["run"],
        samples=prompts["max_samples"],
        shard_size=prompts["shard_size"],
        train_shards=len(split.training),
        eval_shards=len(split.heldout),
        tokens=tokens,
        train_tokens_per_epoch=epoch_train_tokens(config, assumptions, split),
        hidden_bytes_per_token=per_token,
        assumptions=assumptions,
        stages=stages,
        stores=stores,
        notes=planning_notes(len(split.training) + len(split.heldout))
        + plan_notes(config, assumptions)
        + budget_notes(config, splits["budget"], assumptions.cache_gb, assumptions.hidden_size),
    )


def stage_rows(
    config: dict[str, Any],
    assumptions: Assumptions,
    scale: Scale,
    split: ShardSplit,
    tokens: float,
    per_token: int,
) -> list[StageRow]:
    """Jobs (rule by rule, as rules/*.smk plan them), shards, disk and hours of every stage."""
    train_shards, eval_shards = len(split.training), len(split.heldout)
    shards = train_shards + eval_shards
    rates, epochs = assumptions.rates, config["train"]["epochs"]
    families = len(config["train"]["families"])
    hidden = config["hidden"]
    verify = hidden["backend"] == "vllm" and hidden["verify_samples"] > 0
    files = {name: tokens * b for name, b in DEMO_BYTES_PER_TOKEN.items()}
    servers = scale.capture_servers
    capture_note = f"{servers} capture server(s)" if servers else "1 engine at a time"
    # The config's hidden.store: shards stored as files (run/split.py), the rest asked of the
    # capture servers by the jobs that read them.
    stored = len(split.stored)
    stored_samples = sum(len(range(*shard_bounds(config, s))) for s in split.stored)
    hidden_jobs = {
        "extract_hidden_states": stored,
        "verify_hidden_states": int(verify),
        "save_target_head": 1,
    }
    train_tokens = epoch_train_tokens(config, assumptions, split) * epochs
    # With the engine, one plain decoding for every family's evaluation (decode_plain).
    engine = config["evaluate"]["engine"] == "vllm"
    evaluate_jobs = {"decode_plain": int(engine), "evaluate_drafter": families}
    return [
        StageRow(
            "demo target",
            {"build_demo_target": int(config["demo_target"]["enabled"])},
            0,
            0.0,
            None,
        ),
        StageRow("prompts", {"prepare_prompts": 1}, shards, 0.0, None),
        StageRow("probe", {"probe_endpoints": 1}, 0, 0.0, None),
        StageRow(
            "generate",
            {"generate_responses": shards},
            shards,
            files["raw"],
            hours(tokens, rates.generate_tokens_per_s, scale.endpoints),
            f"{scale.endpoints} endpoint(s)",
        ),
        StageRow(
            "samples",
            {"prepare_samples": shards, "build_draft_vocab": 1},
            shards,
            files["samples"] + files["tokens"],
            None,
        ),
        StageRow(
            "hidden",
            hidden_jobs,
            shards,
            tokens * per_token * stored_samples / config["prompts"]["max_samples"],
            hours(tokens, rates.capture_tokens_per_s, servers),
            f"{capture_note}, hidden.store {hidden.get('store', 'files')}",
        ),
        StageRow(
            "train",
            {"train_drafter": families},  # one job a family, each over every training token
            train_shards,
            0.0,
            families * hours(train_tokens, rates.train_tokens_per_s, scale.processes),
            f"{epochs} epochs of {sequence_label(config)} on {scale.processes} process(es), "
            f"{families} famil"
            f"{'y' if families == 1 else 'ies'} at the one rate",
        ),
        StageRow("evaluate", evaluate_jobs, eval_shards, 0.0, None),
        StageRow("report", {"build_report": 1}, shards, 0.0, None),
    ]


def plan_notes(config: dict[str, Any], assumptions: Assumptions) -> list[str]:
    rates = assumptions.rates
    demo = [
        name.split("_")[0] for name, value in DEMO_RATES.items() if getattr(rates, name) == value
    ]
    notes = [
        (
            f"tokens per sample: {assumptions.tokens_per_sample:,.0f} (assumed; "
            f"generation.max_tokens is {config['generation']['max_tokens']:,}; "
            "--tokens-per-sample)"
        ),
        (
            f"rates: generate {rates.generate_tokens_per_s:,.0f} tokens/s per endpoint, capture "
            f"{rates.capture_tokens_per_s:,.0f} per engine, train "
            f"{rates.train_tokens_per_s:,.0f} per process"
        ),
    ]
    if demo:
        flags = ", ".join(f"--{name}-tokens-per-s" for name in demo)
        notes.append(
            f"the {', '.join(demo)} rate(s) are the CPU demo's (two cores, whole jobs of a tiny "
            f"run), not your cluster's: the hours size nothing else; give yours with {flags}"
        )
    notes += [
        (
            "capture hours: on the capture servers, over all epochs (none and budget capture "
            "what they do not store again every epoch, while training runs); held-out shards "
            "once"
        ),
        "not counted: the prompt list, vocab, target head, drafter and journals (GBs at most)",
        train_cost_note(config, assumptions),
    ]
    return notes


def train_cost_note(config: dict[str, Any], assumptions: Assumptions) -> str:
    """What bounds a training step, beside what the disk holds."""
    sequence = config["train"]["sequence"]
    viewed = viewed_tokens_per_sample(config, assumptions.tokens_per_sample)
    stored = (
        "hidden-state disk is per stored token (whole answers, "
        f"~{assumptions.tokens_per_sample:,.0f} a sample)"
    )
    if sequence["mode"] == "whole":
        return (
            f"{stored}; training reads whole samples (train.sequence.mode whole): a step's cost "
            "follows the longest answer"
        )
    return (
        f"{stored}; training reads at most train.sequence.length {sequence['length']:,} tokens "
        f"a sample ({sequence['mode']}: ~{viewed:,.0f} a sample), which bounds a step's cost"
    )


def store_row(
    mode: str,
    split: ShardSplit,
    tokens: float,
    per_token: int,
    other_bytes: float,
    config: dict[str, Any],
    assumptions: Assumptions,
    engines: int,
) -> StoreRow:
    """Disk and capture time of one hidden.store mode, its shards split as the workflow splits
    them (run/split.py). Held-out shards are captured once in every mode (evaluation reads them
    once); training shards that are not stored are captured again each epoch."""
    per_sample = tokens / config["prompts"]["max_samples"]
    samples = {s: len(range(*shard_bounds(config, s))) for s in split.shards}
    stored = sum(samples[s] for s in split.stored) * per_sample
    fetched = sum(samples[s] for s in split.training if s not in split.stored) * per_sample
    captured = tokens + fetched * (config["train"]["epochs"] - 1)
    rate = assumptions.rates.capture_tokens_per_s * engines
    return StoreRow(
        mode=mode,
        extract_jobs=len(split.stored),
        stored_shards=len(split.stored),
        hidden_bytes=stored * per_token,
        total_bytes=stored * per_token + other_bytes,
        capture_hours=captured / rate / 3600,
    )


__all__ = [
    "Assumptions",
    "Rates",
    "RunPlan",
    "format_plan",
    "plan_run",
    "rates_from_run",
    "replace",
]
