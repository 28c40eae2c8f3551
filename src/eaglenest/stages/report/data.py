"""The report's data: a run's files loaded into one `RunData`, and the counts and statistics the
sections and key figures show (rows per stage, drops by reason, quantiles, throughput per shard).

Nothing here draws or formats: figures.py plots these numbers, sections.py and page.py print them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import polars as pl

# The untrained drafter and prompt lookup: what evaluate measures the drafter against.
BASELINE_NAMES = ("untrained", "prompt_lookup")


@dataclass
class FamilyRun:
    """One drafter family's training and evaluation (drafter{suffix}/, eval{suffix}/)."""

    train_lines: list[dict] | None = None
    heldout_lines: list[dict] | None = None
    train_report: dict | None = None
    eval: dict | None = None
    drafter_config: dict | None = None  # drafter{suffix}/config.json, as exported


@dataclass
class RunData:
    """Everything the report shows of one run; None (or empty) where the files are absent.

    The training and evaluation fields are those of `family`, the first family the run has
    (EAGLE-3 where there is one); `families` holds every family's, in FAMILIES order."""

    prompts: dict | None
    probe: dict | None
    samples_reports: dict[str, dict]
    tokens_reports: dict[str, dict]
    hidden: dict[str, dict]
    raw: pl.DataFrame | None
    samples: pl.DataFrame | None
    tokens: pl.DataFrame | None
    generate_wall_s: dict[str, float]
    generate_activity: dict[str, dict]  # raw/{shard}.activity.json by shard
    draft_vocab: dict | None  # vocab/draft_vocab.json
    train_lines: list[dict] | None
    heldout_lines: list[dict] | None
    train_report: dict | None
    eval: dict | None
    drafter_config: dict | None = None  # the first family's drafter config.json
    hidden_verify: dict | None = None  # hidden/verify.json: vLLM against transformers per layer
    family: str = "eagle3"
    families: dict[str, FamilyRun] = field(default_factory=dict)
    compare: dict[str, dict] = field(default_factory=dict)  # eval_compare/{name}.json by name

    def of_family(self, family: str) -> RunData:
        """This run with `family`'s training and evaluation in the place of the first's."""
        own = self.families[family]
        fields = {f.name: getattr(own, f.name) for f in dataclasses.fields(own)}
        return dataclasses.replace(self, family=family, **fields)

    def evaluated_families(self) -> list[str]:
        return [name for name, run in self.families.items() if run.eval is not None]


# ---------------------------------------------------------------------------------------------
# Counts and statistics
# ---------------------------------------------------------------------------------------------


def sum_reports(reports: Iterable[dict], key: str) -> Counter:
    """The counts under `key` of per-shard reports, summed (zero counts left out)."""
    total: Counter = Counter()
    for report in reports:
        total.update({k: v for k, v in (report.get(key) or {}).items() if v})
    return total


def value_counts(series: pl.Series) -> dict[str, int]:
    return dict(sorted(Counter(series.to_list()).items()))


def median(series: pl.Series) -> float | None:
    series = series.drop_nulls()
    return None if series.is_empty() else float(series.median())


def quantiles(values: pl.Series) -> dict[str, Any]:
    values = values.drop_nulls()
    if values.is_empty():
        return {"n": 0, "mean": None, "median": None, "p90": None, "max": None}
    return {
        "n": values.len(),
        "mean": float(values.mean()),
        "median": float(values.median()),
        "p90": float(values.quantile(0.9, interpolation="linear")),
        "max": values.max(),
    }


def funnel_counts(data: RunData) -> list[tuple[str, int]]:
    """How many rows each stage had, in pipeline order (stages without files left out)."""
    stages: list[tuple[str, int]] = []
    if data.prompts:
        stages.append(("prompts read", data.prompts.get("rows_read", data.prompts.get("rows", 0))))
        stages.append(("usable prompts", data.prompts.get("prompts", 0)))
    samples = data.samples_reports.values()
    if samples:
        stages.append(("requested (in shards)", sum(r.get("raw_rows", 0) for r in samples)))
        stages.append(("answered", sum(r.get("answered", 0) for r in samples)))
        stages.append(("validated", sum(r.get("kept", 0) for r in samples)))
    if data.tokens_reports:
        stages.append(("tokenized", sum(r.get("written", 0) for r in data.tokens_reports.values())))
    if data.hidden:
        stages.append(("hidden states", sum(r.get("samples", 0) for r in data.hidden.values())))
    return stages


def drop_counts(data: RunData) -> list[tuple[str, int]]:
    """Every reason a row was dropped, as `stage: reason` with its count over all shards."""
    drops: list[tuple[str, int]] = []
    if data.prompts:
        drops += [(f"prompts: {k}", v) for k, v in (data.prompts.get("skipped") or {}).items() if v]
    drops += [
        (f"validate: {k}", v)
        for k, v in sum_reports(data.samples_reports.values(), "dropped").items()
    ]
    tokens: Counter = Counter()
    for report in data.tokens_reports.values():
        overlength = report.get("overlength") or {}
        tokens["overlength"] += overlength.get("dropped", 0)
        tokens["prompt_over_max_length"] += overlength.get("dropped_prompt_over_max_length", 0)
        tokens["rebuild_decode_mismatch"] += report.get("dropped_rebuild_decode_mismatch", 0)
    drops += [(f"tokenize: {k}", v) for k, v in tokens.items() if v]
    return drops


def answered_requests(raw: pl.DataFrame) -> tuple[pl.DataFrame, pl.Series]:
    """(the requests that got an answer, their completion tokens per second of latency)."""
    answered = raw.filter(pl.col("error_kind").is_null())
    rate = answered.filter(pl.col("latency_s") > 0).select(
        (pl.col("completion_tokens") / pl.col("latency_s")).alias("rate")
    )["rate"]
    return answered, rate


def shard_throughput(raw: pl.DataFrame, wall_s: dict[str, float]) -> list[list[Any]]:
    """Per shard with a wall time: [shard, requests, completion tokens, wall s, tokens/s,
    requests/s]."""
    rows = []
    for shard, frame in sorted(raw.group_by("shard"), key=lambda g: g[0][0]):
        shard = shard[0]
        if shard not in wall_s or wall_s[shard] <= 0:
            continue
        tokens = int(frame["completion_tokens"].fill_null(0).sum())
        seconds = wall_s[shard]
        rows.append(
            [shard, frame.height, tokens, seconds, tokens / seconds, frame.height / seconds]
        )
    return rows


# Shard jobs that start more than this after the previous ones ended belong to a later run.
SESSION_GAP_S = 60.0


def latest_session(jobs: list[dict]) -> list[dict]:
    """The shard jobs of the latest generation session: jobs that ran at once or one after
    another without a pause, as one `snakemake` run schedules them (a shard regenerated days
    later is a session of its own)."""
    jobs = sorted(jobs, key=lambda j: j["started_at"])
    session: list[dict] = []
    for job in jobs:
        if session and job["started_at"] > max(j["finished_at"] for j in session) + SESSION_GAP_S:
            session = []
        session.append(job)
    return session


def endpoint_utilisation(activity: dict[str, dict]) -> list[dict[str, Any]]:
    """Per endpoint over the latest session of shard jobs: cap, jobs, wall time, busy
    slot-seconds, utilisation (busy / (cap x wall)), the most requests in flight over all jobs
    and the most the server said it queued when sampled, and the in-flight samples over time."""
    by_url: dict[str, list[dict]] = {}
    for job in activity.values():
        for endpoint in job["endpoints"]:
            by_url.setdefault(endpoint["url"], []).append(
                endpoint | {"started_at": job["started_at"], "finished_at": job["finished_at"]}
            )
    rows = []
    for url, jobs in sorted(by_url.items()):
        session = latest_session(jobs)
        start = min(j["started_at"] for j in session)
        wall_s = max(j["finished_at"] for j in session) - start
        cap = max(j["cap"] for j in session)
        busy_s = sum(j["busy_s"] for j in session)
        samples = sorted(s for j in session for s in j["samples"])
        waiting = [s[4] for s in samples if s[4] is not None]
        rows.append(
            {
                "url": url,
                "cap": cap,
                "jobs": len(session),
                "wall_s": wall_s,
                "busy_s": busy_s,
                "utilisation": busy_s / (cap * wall_s) if wall_s > 0 else None,
                "max_in_flight": max((s[1] for s in samples), default=None),
                "max_server_waiting": max(waiting, default=None),
                "in_flight": [(s[0] - start, s[1]) for s in samples],
            }
        )
    return rows


def hidden_totals(summaries: Iterable[dict]) -> tuple[int, int, float | None]:
    """(tokens, bytes, bytes per token) over the hidden-state summaries."""
    summaries = list(summaries)
    tokens = sum(s.get("tokens", 0) for s in summaries)
    size = sum(s.get("bytes", 0) for s in summaries)
    return tokens, size, size / tokens if tokens else None


def temperature_rows(engine: dict[str, Any], ks: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(K, figures) of the serving engine's every K at each temperature measured: greedy, then
    sampled (eval/metrics.json `engine.per_k`, `engine.sampled.per_k`)."""
    sampled = (engine.get("sampled") or {}).get("per_k") or {}
    rows = []
    for k in ks:
        for figures in ((engine.get("per_k") or {}).get(k), sampled.get(k)):
            if figures:
                rows.append((k, figures))
    return rows


def positions(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """The bins of an engine figure's acceptance by generated position ([] without a record)."""
    return (figures.get("by_position") or {}).get("bins") or []
