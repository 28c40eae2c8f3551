"""A synthetic finished run for the report: every file the stages write, in their layouts
(checked against their pandera schemas), small enough to build in a test; and a check that a
report page references no missing file. Used by tests/unit/stages/report/ and the report rule's
workflow test."""

from __future__ import annotations

import copy
import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import polars as pl

from eaglenest.formats.lengths import write_shard_lengths
from eaglenest.formats.prompts import MESSAGE_DTYPE
from eaglenest.formats.raw import RAW_SCHEMA, RawSchema
from eaglenest.formats.samples import SAMPLE_COLUMNS, SamplesSchema, with_thinking
from eaglenest.formats.token_counts import TokenCounts, write_token_counts
from eaglenest.formats.tokens import TokensSchema
from eaglenest.settings.vocab import VocabSettings
from eaglenest.stages.vocab import build_draft_vocab

SHARDS = ("00000", "00001")
PER_SHARD = 6
TARGET_VOCAB_SIZE = 128
# Below the 46 distinct ids the synthetic completions use (12..57), as in the demo: coverage < 1.
DRAFT_VOCAB_SIZE = 40
MESSAGE_DTYPE_LIST = pl.List(MESSAGE_DTYPE)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sample_id(shard: str, i: int) -> str:
    return f"{int(shard):08x}{i:08x}"


def raw_frame(shard: str) -> pl.DataFrame:
    rows = []
    for i in range(PER_SHARD):
        failed = i == 0 and shard == "00001"  # one failed request in the run
        rows.append(
            {
                "id": sample_id(shard, i),
                "endpoint": "http://127.0.0.1:8000",
                "request": json.dumps({"max_tokens": 64}),
                "response": None if failed else json.dumps({"choices": []}),
                "reasoning": None if failed else "step " * (5 + i),
                "content": None if failed else f"answer {i}",
                "reasoning_field": "none" if failed else "reasoning_content",
                "finish_reason": None if failed else ("length" if i == 1 else "stop"),
                "prompt_token_ids": None,
                "completion_token_ids": None,
                "token_layout": None,
                "prompt_tokens": None if failed else 10 + i,
                "completion_tokens": None if failed else 20 + 3 * i,
                "latency_s": 0.5 + 0.1 * i,
                "attempts": 2 if i == 2 else 1,
                "error_kind": "timeout" if failed else None,
                "error": "timed out" if failed else None,
            }
        )
    return RawSchema.validate(pl.DataFrame(rows, schema=RAW_SCHEMA))


def samples_frame(raw: pl.DataFrame) -> pl.DataFrame:
    kept = raw.filter(pl.col("error_kind").is_null() & (pl.col("finish_reason") != "length"))
    messages = [[{"role": "user", "content": f"question {i}"}] for i in range(kept.height)]
    frame = kept.with_columns(pl.Series("messages", messages, dtype=MESSAGE_DTYPE_LIST))
    frame = with_thinking(frame).select(SAMPLE_COLUMNS)
    return SamplesSchema.validate(frame)


def tokens_frame(samples: pl.DataFrame) -> pl.DataFrame:
    lengths = [30 + 7 * i for i in range(samples.height)]
    frame = pl.DataFrame(
        {
            "id": samples["id"],
            "input_ids": [list(range(n)) for n in lengths],
            "prompt_len": [12] * samples.height,
            "n_tokens": lengths,
            "token_source": ["rebuilt"] * samples.height,
            "truncated": [False] * samples.height,
            "rebuild_agrees": [None] * samples.height,
            "thinking": samples["thinking"],
        },
        schema_overrides={"input_ids": pl.List(pl.Int64), "rebuild_agrees": pl.Boolean},
    )
    return TokensSchema.validate(frame)


def write_draft_vocab(run: Path) -> dict:
    """The vocab stage on the synthetic tokens: each shard's counts of completion ids, then
    vocab/draft_vocab.json as build_draft_vocab writes it."""
    paths = []
    for shard in SHARDS:
        tokens = pl.read_parquet(run / "tokens" / f"{shard}.parquet")
        completion = [i for ids, n in tokens.select("input_ids", "prompt_len").iter_rows()
                      for i in ids[n:]]  # fmt: skip
        counts = np.bincount(completion, minlength=TARGET_VOCAB_SIZE).astype(np.int64)
        paths.append(run / "tokens" / f"{shard}.counts.safetensors")
        write_token_counts(paths[-1], TokenCounts(counts, np.zeros(0, dtype=np.int64), {}), shard)
    vocab = run / "vocab"
    vocab.mkdir(parents=True, exist_ok=True)
    return build_draft_vocab(
        paths,
        vocab / "draft_vocab.safetensors",
        vocab / "draft_vocab.json",
        VocabSettings(DRAFT_VOCAB_SIZE),
    )


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


EVAL_METRICS = {
    "ks": [3, 7],
    "heldout_shards": ["00001"],
    "simulated": {
        "3": {
            "acceptance_length": 2.41,
            "conditional_acceptance": [0.8, 0.6, 0.4],
            "positions": 900,
        },
        "7": {
            "acceptance_length": 2.87,
            "conditional_acceptance": [0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05],
            "positions": 900,
        },
    },
    "live": {
        "3": {
            "acceptance_length": 2.33,
            "target_forwards_per_token": 0.43,
            "speedup": 1.73,
            "tokens": 512,
            "prompts": 8,
            "identical_to_greedy": True,
            "spec_wall_s": 3.1,
            "greedy_wall_s": 5.4,
            # The times the families' choice reads (evaluate's live loop).
            "emitted_per_round": 2.3,
            "drafter_s_per_round": 0.004,
            "target_s_per_round": 0.010,
            "greedy_s_per_token": 0.008,
        },
        "7": {
            "acceptance_length": 2.79,
            "target_forwards_per_token": 0.36,
            "speedup": 1.52,
            "tokens": 512,
            "prompts": 8,
            "identical_to_greedy": False,
            "spec_wall_s": 3.5,
            "greedy_wall_s": 5.4,
            "emitted_per_round": 2.7,
            "drafter_s_per_round": 0.009,
            "target_s_per_round": 0.012,
            "greedy_s_per_token": 0.008,
        },
    },
    # evaluate.py also writes these (beyond the contract): shown when present
    "live_baselines": {
        "prompt_lookup": {
            "3": {"acceptance_length": 1.27, "speedup": 1.08, "identical_to_greedy": True},
            "7": {"acceptance_length": 1.29, "speedup": 1.01, "identical_to_greedy": True},
        }
    },
    "live_skipped_reason": None,
    "baselines": {
        "untrained": {
            "3": {"acceptance_length": 1.02, "conditional_acceptance": [0.02, 0.0, 0.0]},
            "7": {"acceptance_length": 1.02, "conditional_acceptance": [0.02] + [0.0] * 6},
        },
        "prompt_lookup": {
            "3": {"acceptance_length": 1.31, "conditional_acceptance": [0.25, 0.1, 0.05]},
            "7": {
                "acceptance_length": 1.36,
                "conditional_acceptance": [0.25, 0.1, 0.05] + [0.0] * 4,
            },
        },
    },
}


def write_training(run: Path, ttt_steps: int = 3, folder: str = "drafter") -> None:
    lines = []
    for step in range(1, 41):
        acc = [min(0.9, 0.02 * step / (i + 1)) for i in range(ttt_steps)]
        lines.append(
            {
                "split": "train",
                "step": step,
                "epoch": step / 20,
                "lr": 1e-3,
                "loss": 5.0 / step,
                "acc": acc,
                "loss_tokens": 100 * step,
                "skipped_outside_vocab": step,
                "tokens_per_s": 950.0 + step,
                "elapsed_s": 0.5 * step,
            }
        )
        if step % 10 == 0:
            lines.append({"split": "heldout", "step": step, "loss": 6.0 / step, "acc": acc})
    path = run / folder / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # What the report reads of the export (depth health's configured positions).
    write_json(
        run / folder / "config.json",
        {
            "max_position_embeddings": 2048,
            "rope_theta": 1e6,
            "eaglenest": {"trained_positions": 640},
        },
    )
    write_json(
        run / folder / "train_report.json",
        {
            "steps": 40,
            "epochs": 2.0,
            "ttt_steps": ttt_steps,
            "train_tokens": 4000,
            "wall_s": 20.0,
            "tokens_per_s": 990.0,
            "train_acc": [0.8, 0.4, 0.2667],
            "heldout_acc": [0.7123, 0.35, 0.2],
            "heldout_loss": 0.15,
            "skipped_outside_vocab_share": 0.0125,
            "eval_shards": ["00001"],
            "train_shards": ["00000"],
        },
    )


def family_eval(
    ks: list[int], per_depth: dict[int, tuple[float, float]], family: str = "eagle3"
) -> dict:
    """A family's eval/metrics.json: EVAL_METRICS at `ks` (of 3 and 7), with a depth table whose
    live rows at each depth have (emitted tokens per round, drafter seconds per round), the same
    at every K; the target takes 10 ms a round to verify, 8 ms a token to decode plainly."""
    metrics = copy.deepcopy(EVAL_METRICS)
    keep = [str(k) for k in ks]
    for name in ("simulated", "live"):
        metrics[name] = {k: v for k, v in metrics[name].items() if k in keep}
    metrics.update(family=family, ks=ks)
    rows = {
        k: [
            {
                "depth": depth,
                "prompts": 4,
                "simulated": {"acceptance_length": emitted + 0.1, "positions": 100},
                "live": {
                    "acceptance_length": emitted + 0.05,
                    "emitted_per_round": emitted,
                    "rounds": 20,
                    "tokens": int(20 * emitted) + 4,
                    "prompts": 4,
                    "identical_to_greedy": True,
                    "drafter_s_per_round": drafter_s,
                    "target_s_per_round": 0.010,
                    "greedy_s_per_token": 0.008,
                },
                "engine": None,
            }
            for depth, (emitted, drafter_s) in per_depth.items()
        ]
        for k in keep
    }
    metrics["by_depth"] = {
        "depths": list(per_depth),
        "continuation_tokens": 16,
        "samples": {str(d): {"prompts": 4, "too_short": 0} for d in per_depth},
        "per_k": rows,
    }
    return metrics


def write_family(run: Path, family: str, metrics: dict) -> None:
    """A family's training (drafter{suffix}/) and evaluation (eval{suffix}/) in a run."""
    suffix = "" if family == "eagle3" else f"_{family}"
    write_training(run, folder=f"drafter{suffix}")
    write_json(run / f"eval{suffix}" / "metrics.json", metrics)


class Headings(HTMLParser):
    """The page's sections: (id, title) of every h2."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[tuple[str, str]] = []
        self._open: str | None = None

    def handle_starttag(self, tag, attrs) -> None:
        if tag == "h2":
            self._open = dict(attrs).get("id") or ""
            self.sections.append((self._open, ""))

    def handle_data(self, data) -> None:
        if self._open is not None:
            section_id, title = self.sections[-1]
            self.sections[-1] = (section_id, title + data)

    def handle_endtag(self, tag) -> None:
        if tag == "h2":
            self._open = None


def page_sections(page: Path) -> dict[str, str]:
    """The page's sections by id (h2 id -> its title)."""
    parser = Headings()
    parser.feed(page.read_text())
    return dict(parser.sections)


ENDPOINT = "http://10.0.0.5:8000"


def write_activity(run: Path, shard: str) -> None:
    """logs/{run}/generate_responses/{shard}.activity.json of a shard job: the two jobs overlap, each busy 48 slot-seconds
    on a cap of 8 over its 10 s."""
    start = 1_000_000.0 + 5 * int(shard)
    samples = [[start + t, 8, 4, 6.0, 2.0] for t in (0.0, 5.0)]
    endpoint = {"url": ENDPOINT, "cap": 8, "attempts": 6, "busy_s": 48.0, "samples": samples}
    job = {"started_at": start, "finished_at": start + 10.0, "endpoints": [endpoint]}
    logs = run.parents[1] / "logs" / run.name / "generate_responses"
    write_json(logs / f"{shard}.activity.json", job)


def write_run(root: Path, run_name: str = "synthetic", finished: bool = True) -> Path:
    """results/{run}/ with every file the report reads (training and eval only when finished),
    and benchmarks/{run}/generate/*.tsv."""
    run = root / "results" / run_name
    write_json(
        run / "prompts" / "report.json",
        {
            "rows_read": 15,
            "rows": 15,
            "prompts": 13,
            "skipped": {"duplicate": 2, "too_long": 0},
        },
    )
    write_json(
        run / "probe.json",
        {
            "reasoning_field": "reasoning_content",
            "token_ids": {"supported": False, "layout": None},
            "think_token_ids": {
                "start": "<think>",
                "start_id": 151667,
                "end": "</think>",
                "end_id": 151668,
            },
        },
    )
    for shard in SHARDS:
        raw = raw_frame(shard)
        samples = samples_frame(raw)
        tokens = tokens_frame(samples)
        for folder, frame in (("raw", raw), ("samples", samples), ("tokens", tokens)):
            (run / folder).mkdir(parents=True, exist_ok=True)
            frame.write_parquet(run / folder / f"{shard}.parquet")
        tokens_dir = run / "tokens"
        write_shard_lengths(
            run / "samples" / f"{shard}.parquet",
            tokens_dir / f"{shard}.parquet",
            tokens_dir / f"{shard}.lengths.parquet",
        )
        dropped = {"truncated": 1} | ({"request_failed:timeout": 1} if shard == "00001" else {})
        write_json(
            run / "samples" / f"{shard}.report.json",
            {
                "shard": shard,
                "raw_rows": raw.height,
                "answered": raw.height - (shard == "00001"),
                "kept": samples.height,
                "dropped": dropped,
                "reasoning_fields": dict(raw["reasoning_field"].value_counts().iter_rows()),
                "token_layouts": {"None": raw.height},
                "probe_reasoning_field": "reasoning_content",
            },
        )
        write_json(
            run / "tokens" / f"{shard}.report.json",
            {
                "shard": shard,
                "samples": samples.height,
                "written": tokens.height,
                "tokens": int(tokens["n_tokens"].sum()),
                "loss_tokens": 99,
                "token_sources": {"server": 0, "rebuilt": tokens.height},
                "agreement": {
                    "compared": 20,
                    "exact": 19,
                    "prompt_exact": 20,
                    "completion_exact": 19,
                    "share": 0.95,
                    "first_mismatches": [
                        {
                            "id": sample_id(shard, 3),
                            "part": "completion",
                            "position": 4,
                            "server_ids": [1],
                            "server_text": "a",
                            "rebuilt_ids": [2],
                            "rebuilt_text": "b",
                        }
                    ],
                },
                "overlength": {
                    "max_length": 64,
                    "policy": "drop",
                    "dropped": 1,
                    "dropped_prompt_over_max_length": 0,
                    "truncated": 0,
                },
                "dropped_rebuild_decode_mismatch": 0,
            },
        )
        n_tokens = int(tokens["n_tokens"].sum())
        write_json(
            run / "hidden" / f"{shard}.json",
            {
                "samples": tokens.height,
                "tokens": n_tokens,
                "bytes": 600 * n_tokens,
                "bytes_per_token": 600.0,
                "hidden_size": 128,
                "aux_layer_ids": [2, 4, 5],
                "dtype": "fp8",
                "target_signal": "final_hidden",
                "seconds": 1.5,
                "forward_seconds": 1.0,
                "tokens_per_s": n_tokens / 1.5,
            },
        )
        write_activity(run, shard)
        bench = root / "benchmarks" / run_name / "generate" / f"{shard}.tsv"
        bench.parent.mkdir(parents=True, exist_ok=True)
        bench.write_text("s\th:m:s\tmax_rss\n2.50\t0:00:02\t100.0\n")
    write_draft_vocab(run)
    if finished:
        write_training(run)
        write_json(run / "eval" / "metrics.json", EVAL_METRICS)
    return run


class References(HTMLParser):
    """Every src/href in a page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.links += [value for name, value in attrs if name in ("src", "href") and value]


def missing_references(page: Path) -> list[str]:
    parser = References()
    parser.feed(page.read_text())
    assert parser.links, "the page shows no image"
    return [
        link
        for link in parser.links
        if not link.startswith(("data:", "#")) and not (page.parent / link).exists()
    ]
