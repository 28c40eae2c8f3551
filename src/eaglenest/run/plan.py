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

`hidden.store` (files: every state stored, today's pipeline; none: none stored, training asks the
capture servers for each batch every epoch; budget: the shards that fit in `hidden.cache_gb`
stored, the rest captured every epoch) is planned for all three modes.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eaglenest.run.shards import shard_bounds
from eaglenest.run.split import ShardSplit, split_shards
from eaglenest.run.store import hidden_bytes_per_token, target_hidden_size
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


def plan_run(config: dict[str, Any], assumptions: Assumptions) -> RunPlan:
    """The plan of a validated config (schema defaults filled in)."""
    prompts = config["prompts"]
    splits = {
        mode: split_shards(config, mode, assumptions.cache_gb, assumptions.hidden_size)
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
        hidden_bytes_per_token=per_token,
        assumptions=assumptions,
        stages=stages,
        stores=stores,
        notes=plan_notes(config, assumptions),
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
    train_tokens = tokens * train_shards / shards * epochs
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
            {"train_drafter": 1},
            train_shards,
            0.0,
            hours(train_tokens, rates.train_tokens_per_s, scale.processes),
            f"{epochs} epochs on {scale.processes} process(es)",
        ),
        StageRow("evaluate", {"evaluate_drafter": 1}, eval_shards, 0.0, None),
        StageRow("report", {"build_report": 1}, shards, 0.0, None),
    ]


def plan_notes(config: dict[str, Any], assumptions: Assumptions) -> list[str]:
    rates = assumptions.rates
    return [
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
        (
            "capture hours: on the capture servers, over all epochs (none and budget capture "
            "what they do not store again every epoch, while training runs); held-out shards "
            "once"
        ),
        "not counted: the prompt list, vocab, target head, drafter and journals (GBs at most)",
    ]


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


# --- measuring the rates ----------------------------------------------------------------------


def rates_from_run(workdir: str | Path, run: str) -> tuple[dict[str, float], dict[str, float]]:
    """(rates, bytes per token) of a finished run: generation's tokens (prompts and answers, as
    the plan counts them) over its jobs' seconds (benchmarks/), capture's over the target's
    forward seconds (hidden/*.json), training's from its report; the raw, samples and tokens
    files' sizes over the tokens they hold."""
    root = Path(workdir)
    results = root / "results" / run
    shard_tokens: dict[str, int] = {}
    capture_s = 0.0
    for summary_path in sorted((results / "hidden").glob("[0-9]*.json")):
        summary = json.loads(summary_path.read_text())
        shard_tokens[summary_path.stem] = int(summary["tokens"])
        # The target's own time: its load is paid once a server, not once a token.
        capture_s += float(summary.get("forward_seconds") or summary["seconds"])
    tokens = sum(shard_tokens.values())
    generate_s = sum(
        benchmark_seconds(root / "benchmarks" / run / "generate" / f"{shard}.tsv")
        for shard in shard_tokens
    )
    report = json.loads((results / "drafter" / "train_report.json").read_text())
    rates = {
        "generate_tokens_per_s": tokens / generate_s,
        "capture_tokens_per_s": tokens / capture_s,
        "train_tokens_per_s": float(report["tokens_per_s"]),
    }
    sizes = {
        "raw": sum((results / "raw" / f"{s}.parquet").stat().st_size for s in shard_tokens),
        "samples": sum((results / "samples" / f"{s}.parquet").stat().st_size for s in shard_tokens),
        "tokens": sum((results / "tokens" / f"{s}.parquet").stat().st_size for s in shard_tokens),
    }
    return rates, {name: size / tokens for name, size in sizes.items()}


def benchmark_seconds(path: Path) -> float:
    with open(path) as stream:
        return float(next(csv.DictReader(stream, delimiter="\t"))["s"])


# --- text --------------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def human_hours(h: float | None) -> str:
    if h is None:
        return "-"
    return f"{h:,.1f} h" if h >= 0.1 else f"{h * 60:,.1f} min"


def format_plan(plan: RunPlan) -> str:
    a = plan.assumptions
    title = (
        f"run {plan.run}: {plan.samples:,} samples in {plan.shards:,} shards of "
        f"{plan.shard_size:,} ({plan.train_shards:,} trained on, {plan.eval_shards:,} held out), "
        f"~{plan.tokens:,.3g} tokens"
    )
    lines = [
        title,
        f"hidden states: {plan.hidden_bytes_per_token:,} bytes/token (hidden size {a.hidden_size:,})",
        "",
        f"{'stage':<12} {'jobs':>7} {'shards':>7} {'disk (files)':>13} {'hours':>10}  rules",
    ]
    for row in plan.stages:
        jobs = sum(row.jobs.values())
        if not jobs:
            continue
        rules = ", ".join(f"{rule} {n:,}" for rule, n in row.jobs.items() if n)
        disk = human_bytes(row.disk_bytes) if row.disk_bytes else "-"
        note = f" ({row.note})" if row.note else ""
        lines.append(
            f"{row.stage:<12} {jobs:>7,} {f'{row.shards:,}' if row.shards else '-':>7} {disk:>13} "
            f"{human_hours(row.hours):>10}  {rules}{note}"
        )
    header = (
        f"{'hidden.store':<14} {'capture jobs':>12} {'hidden disk':>12} {'total disk':>11} "
        f"{'capture hours':>14}"
    )
    lines += ["", header]
    for row in plan.stores:
        label = {"files": "files", "none": "none", "budget": f"budget {a.cache_gb:,.0f} GB"}
        kept = (
            f"first {row.stored_shards:,} training shard(s) stored" if row.mode == "budget" else ""
        )
        line = (
            f"{label[row.mode]:<14} {row.extract_jobs:>12,} {human_bytes(row.hidden_bytes):>12} "
            f"{human_bytes(row.total_bytes):>11} {human_hours(row.capture_hours):>14}  "
            f"{kept}"
        )
        lines.append(line.rstrip())
    lines += ["", *(f"- {note}" for note in plan.notes)]
    return "\n".join(lines)


# --- the command -------------------------------------------------------------------------------


def add_arguments(parser: Any) -> None:
    parser.add_argument("--configfile", nargs="+", required=True, help="the run's config files")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. prompts.max_samples=500000 (repeatable)",
    )
    parser.add_argument("--samples", type=int, help="prompts.max_samples")
    parser.add_argument("--tokens-per-sample", type=float, help="default: generation.max_tokens/2")
    parser.add_argument("--hidden-size", type=int, help="default: the target's config")
    parser.add_argument("--cache-gb", type=float, help="hidden.cache_gb of the budget mode")
    for name, help_text in (
        ("generate", "per endpoint"),
        ("capture", "per capture engine"),
        ("train", "per training process (GPU)"),
    ):
        key = f"{name}_tokens_per_s"
        parser.add_argument(
            f"--{name}-tokens-per-s",
            type=float,
            default=DEMO_RATES[key],
            help=f"{help_text}; default {DEMO_RATES[key]:,.0f}, measured on the demo here",
        )


def overridden(config: dict[str, Any], settings: list[str]) -> dict[str, Any]:
    """`config` with `section.key=value` overrides (values read as YAML)."""
    import yaml

    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set {item!r}: expected section.key=value")
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return config


def run(args: Any) -> int:
    import yaml

    from eaglenest.common.config import ConfigError, merged_config, validate_config

    try:
        config = merged_config(args.configfile)
        overrides = list(args.set) + (
            [f"prompts.max_samples={args.samples}"] if args.samples else []
        )
        config = overridden(yaml.safe_load(yaml.safe_dump(config)), overrides)
        validate_config(config)
        hidden_size = args.hidden_size or target_hidden_size(config)
    except (ConfigError, ValueError) as err:
        print(f"eaglenest plan: {err}")
        return 2
    tokens_per_sample = args.tokens_per_sample or config["generation"]["max_tokens"] / 2
    cache_gb = args.cache_gb or config["hidden"].get("cache_gb") or DEFAULT_CACHE_GB
    rates = Rates(args.generate_tokens_per_s, args.capture_tokens_per_s, args.train_tokens_per_s)
    plan = plan_run(config, Assumptions(tokens_per_sample, hidden_size, rates, cache_gb))
    print(format_plan(plan))
    return 0


__all__ = [
    "Assumptions",
    "Rates",
    "RunPlan",
    "format_plan",
    "plan_run",
    "rates_from_run",
    "replace",
]
