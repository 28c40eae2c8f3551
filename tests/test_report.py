"""The run report: built from a synthetic finished run whose files have the layouts the stages
write (checked against their pandera schemas), plus a real Snakemake run of the report rule."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from support.workflow import SMALL_RUN

from eaglenest.formats.lengths import read_shard_lengths, write_shard_lengths
from eaglenest.formats.prompts import MESSAGE_DTYPE
from eaglenest.formats.raw import RAW_SCHEMA, RawSchema
from eaglenest.formats.samples import SAMPLE_COLUMNS, SamplesSchema
from eaglenest.formats.token_counts import TokenCounts, write_token_counts
from eaglenest.formats.tokens import TokensSchema
from eaglenest.settings.vocab import VocabSettings
from eaglenest.stages.report.data import endpoint_utilisation
from eaglenest.stages.report.inputs import ReportInputError, RunFiles, load_run
from eaglenest.stages.report.report import PLOT_NAMES, build_report
from eaglenest.stages.vocab import build_draft_vocab

REPO = Path(__file__).resolve().parents[1]
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
    frame = kept.with_columns(pl.Series("messages", messages, dtype=MESSAGE_DTYPE_LIST)).select(
        SAMPLE_COLUMNS
    )
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


def write_training(run: Path, ttt_steps: int = 3) -> None:
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
    path = run / "drafter" / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    write_json(
        run / "drafter" / "train_report.json",
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


def build(run: Path, out: Path | None = None) -> tuple[Path, dict]:
    out = out or run / "report"
    root = run.parents[1]
    files = RunFiles.from_run_dir(run, root / "benchmarks" / run.name, root / "logs" / run.name)
    figures = build_report(files, out / "index.html", run=run.name)
    return out / "index.html", figures


def test_report_of_a_finished_run(tmp_path: Path):
    page, figures = build(write_run(tmp_path))
    for name in PLOT_NAMES:
        png = page.parent / f"{name}.png"
        assert png.stat().st_size > 1000, name
        assert png.read_bytes().startswith(PNG_MAGIC)
    assert missing_references(page) == []
    text = page.read_text()
    # every section drew its plot: the page embeds one image per plot
    assert text.count("data:image/png;base64,") == len(PLOT_NAMES)
    for expected in (
        "2.41",
        "2.87",  # simulated acceptance length K=3, K=7
        "2.33",
        "1.73",  # live acceptance length and speedup, K=3
        "1.31",
        "1.02",  # baselines
        "1.27",  # live prompt lookup
        "95.0%",  # server/rebuild agreement
        "reasoning_content",
        "rebuilt",  # reasoning field, token source
        "validate: truncated",
        "validate: request_failed:timeout",
        "prompts: duplicate",
        "tokenize: overlength",
        "600",  # hidden bytes per token
        "0.712",  # held-out accuracy of TTT step 1
        "identical_to_greedy",  # K=7 differs from greedy: said in a note
        "completion tokens/s",
        ENDPOINT,  # utilisation: 2 jobs x 48 busy slot-s / (cap 8 x 15 s wall)
        "busy slot-s",
        "<td>80.0%</td>",
        "most queued by the server",
    ):
        assert expected in text, expected
    assert figures["acceptance length K=3 (simulated)"] == 2.41
    assert figures["validated"] == 9  # 2 shards of 6, less 2 cut by max_tokens and 1 failed
    # A draft vocabulary smaller than the ids the completions use: its coverage, below 1, shown.
    vocab = json.loads((page.parents[1] / "vocab" / "draft_vocab.json").read_text())
    assert vocab["distinct_ids_seen"] > vocab["draft_vocab_size"] == DRAFT_VOCAB_SIZE
    assert 0.5 < vocab["coverage"] < 1
    shown = f"{100 * vocab['coverage']:.2f}%"
    assert figures["draft vocabulary coverage"] == shown != "100.00%"
    assert "coverage of completion tokens" in text and f"<td>{shown}</td>" in text
    assert figures["server/rebuild agreement"] == "95.0%"


def test_no_live_acceptance_is_a_note(tmp_path: Path):
    run = write_run(tmp_path)
    metrics = {**EVAL_METRICS, "live": None, "live_baselines": None}
    metrics["live_skipped_reason"] = "no GPU on this machine"
    write_json(run / "eval" / "metrics.json", metrics)
    page, figures = build(run)
    text = page.read_text()
    assert "Live acceptance not measured: no GPU on this machine." in text
    assert "acceptance length K=3 (live)" not in figures
    assert (page.parent / "acceptance.png").stat().st_size > 1000
    assert missing_references(page) == []


def test_the_engines_acceptance_is_shown_beside_live_and_simulated(tmp_path: Path):
    run = write_run(tmp_path)
    engine = {
        "engine": "vllm",
        "per_k": {
            "3": {"acceptance_length": 2.3456, "rounds": 220, "identical_to_plain": True,
                  "per_position_acceptance": [0.81234, 0.6, 0.4]},
            "7": {"acceptance_length": 2.8123, "rounds": 180, "identical_to_plain": True,
                  "per_position_acceptance": [0.8] * 7},
        },
    }  # fmt: skip
    write_json(run / "eval" / "metrics.json", {**EVAL_METRICS, "engine": engine})
    page, figures = build(run)
    text = page.read_text()
    # The engine's figure leads the key figures: what the drafter delivers where it is served.
    acceptance = [name for name in figures if name.startswith("acceptance length")]
    assert acceptance[:2] == ["acceptance length K=3 (vllm)", "acceptance length K=7 (vllm)"]
    assert figures["acceptance length K=3 (vllm)"] == 2.3456
    assert "In the serving engine (vllm)" in text
    assert "vllm&#x27;s own acceptance length" in text and "<td>2.35</td>" in text
    assert "0.812" in text
    assert missing_references(page) == []

    write_json(run / "eval" / "metrics.json", {**EVAL_METRICS, "engine": {"per_k": {"3": {}}}})
    with pytest.raises(ReportInputError, match=r"engine\.per_k\[3\].*acceptance_length"):
        build(run)


def test_the_recipe_the_drafter_was_trained_with_is_shown(tmp_path: Path):
    run = write_run(tmp_path)
    report = json.loads((run / "drafter" / "train_report.json").read_text())
    settings = {"loss": "forward_kl", "target_outside_vocab": "ignore", "step_weight": 0.8,
                "ttt_steps": 3, "ttt_inputs": "drafter", "lm_head_init": "target_frozen",
                "aux_noise": 0.05, "lr": 0.003, "adam_betas": [0.9, 0.999],
                "weight_decay": 0.01, "grad_clip": 1.0, "warmup_steps": 10, "min_lr_ratio": 0.0,
                "epochs": 30, "max_batch_tokens": 2048}  # fmt: skip
    drafter = {"norm_before_residual": True, "norm_output": True, "fc_norm": False}
    write_json(run / "drafter" / "train_report.json",
               {**report, "settings": settings, "drafter": drafter})  # fmt: skip
    page, _ = build(run)
    text = page.read_text()
    for expected in (
        "<h3>Recipe</h3>",
        "EAGLE-3 with norm_before_residual, norm_output",
        "forward_kl; target mass outside the draft vocab: ignore",
        "3 / drafter tokens",
        "target_frozen",
        "betas (0.9, 0.999), weight decay 0.01, grad clip 1",
        "cosine to 0 x lr; 30 epochs",
    ):
        assert expected in text, expected
    assert missing_references(page) == []


def test_a_run_not_trained_yet_renders_notes(tmp_path: Path):
    run = write_run(tmp_path, finished=False)
    shutil.rmtree(run / "hidden")
    page, _ = build(run)
    text = page.read_text()
    assert "Not trained yet" in text
    assert "Not evaluated yet" in text
    assert "coverage of completion tokens" in text  # the vocabulary is built before training
    assert "No hidden-state summaries" in text
    for name in PLOT_NAMES:  # every declared output exists, a card saying why where no plot
        assert (page.parent / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
    assert text.count("data:image/png;base64,") == 3  # funnel, lengths, generation


@pytest.mark.parametrize(
    ("relative", "content", "message"),
    [
        (
            "drafter/metrics.jsonl",
            '{"split": "train", "step": 1, "loss": 1.0, "acc": [0.5]}\n{oops\n',
            r"metrics\.jsonl line 2: not JSON",
        ),
        (
            "drafter/metrics.jsonl",
            '{"split": "train", "step": 1, "loss": "high", "acc": [0.5]}\n',
            r"metrics\.jsonl line 1: 'loss' must be a number",
        ),
        (
            "drafter/metrics.jsonl",
            '{"split": "valid", "step": 1, "loss": 1.0, "acc": []}\n',
            r"metrics\.jsonl line 1: 'split' must be train or heldout",
        ),
        ("drafter/train_report.json", "[1, 2]", r"train_report\.json: expected a JSON object"),
        (
            "eval/metrics.json",
            '{"ks": [3], "simulated": {}}',
            r"eval/metrics\.json: 'simulated' has no entry for K=3",
        ),
        (
            "eval/metrics.json",
            json.dumps(
                {**EVAL_METRICS, "baselines": {"untrained": {"3": {"acceptance_length": 1.0}}}}
            ),
            r"eval/metrics\.json baselines\[untrained\]\[3\]: missing 'conditional_acceptance'",
        ),
        ("eval/metrics.json", "{", r"eval/metrics\.json: not readable as JSON"),
        (
            "vocab/draft_vocab.json",
            '{"coverage": "most", "draft_vocab_size": 40, "target_vocab_size": 128}',
            r"draft_vocab\.json: 'coverage' must be a number",
        ),
        ("samples/00000.report.json", "", r"samples/00000\.report\.json: not readable as JSON"),
        ("tokens/00001.lengths.parquet", "no", r"tokens/00001\.lengths\.parquet: not a lengths"),
    ],
)
def test_a_malformed_file_is_an_error_naming_it(tmp_path: Path, relative, content, message):
    run = write_run(tmp_path)
    (run / relative).write_text(content)
    with pytest.raises(ReportInputError, match=message):
        build(run)


def test_run_files_take_single_paths_and_skip_missing_benchmarks(tmp_path: Path):
    run = write_run(tmp_path)
    files = RunFiles.from_run_dir(run)
    files.raw = str(run / "raw" / "00000.parquet")  # what Snakemake gives for a one-shard list
    files.__post_init__()
    files.generate_benchmarks = [tmp_path / "absent.tsv"]
    page = tmp_path / "out" / "index.html"
    figures = build_report(files, page)
    assert figures["requested (in shards)"] == 2 * PER_SHARD
    assert "throughput per shard is unknown" in page.read_text()


def test_lengths_files_give_the_report_what_the_samples_and_tokens_give(tmp_path: Path):
    run = write_run(tmp_path)
    with_lengths = RunFiles.from_run_dir(run)
    assert len(with_lengths.lengths) == len(SHARDS)
    without = RunFiles.from_run_dir(run)
    without.lengths = []
    loaded, reference = load_run(with_lengths), load_run(without)
    assert loaded.samples.equals(reference.samples)
    assert loaded.tokens.equals(reference.tokens)
    assert build_report(with_lengths, tmp_path / "a.html") == build_report(
        without, tmp_path / "b.html"
    )


def test_a_sample_tokenization_dropped_has_lengths_but_no_tokens(tmp_path: Path):
    raw = raw_frame("00000")
    samples = samples_frame(raw)
    tokens = tokens_frame(samples).slice(1)  # the first sample was dropped at tokenization
    samples.write_parquet(tmp_path / "s.parquet")
    tokens.write_parquet(tmp_path / "t.parquet")
    rows = write_shard_lengths(
        tmp_path / "s.parquet", tmp_path / "t.parquet", tmp_path / "l.parquet"
    )
    sample_lengths, token_lengths = read_shard_lengths(tmp_path / "l.parquet")
    assert rows == sample_lengths.height == samples.height
    assert token_lengths.height == samples.height - 1
    assert sample_lengths["reasoning_chars"].to_list() == [
        len(r) for r in samples["reasoning"].to_list()
    ]
    assert (token_lengths["completion_len"] == tokens["n_tokens"] - tokens["prompt_len"]).all()


# ---------------------------------------------------------------------------------------------
# The rule: a real Snakemake run of build_report over the synthetic run, then `--report`
# ---------------------------------------------------------------------------------------------

SNAKEFILE = """\
configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/report.smk"


report: "report/workflow.rst"
"""


@pytest.mark.slow
def test_report_rule_and_snakemake_report(tmp_path: Path):
    for name in ("rules", "scripts", "config", "src", "report", "envs"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    (tmp_path / "override.yaml").write_text(
        json.dumps({"run": "synthetic", "prompts": {"max_samples": 12, "shard_size": PER_SHARD}})
    )
    write_run(tmp_path)
    command = [sys.executable, "-m", "snakemake", "--cores", "1"]
    config = ["--configfile", "override.yaml"]
    target = "results/synthetic/report/index.html"
    result = subprocess.run(
        [*command, target, *config],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"build_report\s+1", result.stdout + result.stderr)
    page = tmp_path / target
    assert missing_references(page) == []
    assert "2.41" in page.read_text()
    log = (tmp_path / "logs/synthetic/build_report.log").read_text()
    assert "report of run synthetic" in log

    result = subprocess.run(
        [*command, target, "--report", "report.zip", *config],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with zipfile.ZipFile(tmp_path / "report.zip") as archive:
        names = archive.namelist()
        page = archive.read("report/report.html").decode()
    for name in PLOT_NAMES:
        assert any(n.endswith(f"/{name}.png") for n in names), names
    assert "This report covers run" in page  # report/workflow.rst, rendered with the config
    assert "conditional acceptance by draft position" in page  # a caption


@pytest.mark.slow
def test_the_pipelines_report_of_the_demo_run(finished_run: Path):
    """The report `snakemake` built at the end of the small demo run: every plot is there and
    non-empty, the page references no missing file and shows the run's acceptance figures."""
    results = finished_run / "results" / SMALL_RUN
    report = results / "report"
    for name in PLOT_NAMES:
        png = report / f"{name}.png"
        assert png.stat().st_size > 1000, name
        assert png.read_bytes().startswith(PNG_MAGIC)
    page = report / "index.html"
    assert missing_references(page) == []
    metrics = json.loads((results / "eval" / "metrics.json").read_text())
    text = page.read_text()
    for k in metrics["ks"]:
        assert f"{metrics['simulated'][str(k)]['acceptance_length']:.2f}" in text
    assert all(v["identical_to_greedy"] for v in metrics["live"].values())
    # config/config.yaml's draft vocabulary (48 ids) is below the ~55 the completions use.
    vocab = json.loads((results / "vocab" / "draft_vocab.json").read_text())
    assert vocab["distinct_ids_seen"] > vocab["draft_vocab_size"] and vocab["coverage"] < 1
    assert f"<td>{100 * vocab['coverage']:.2f}%</td>" in text


def test_endpoint_utilisation_counts_the_latest_session_only():
    """A shard regenerated an hour after the others is its own session: the report's figures
    are of the latest one."""
    job = {"url": ENDPOINT, "cap": 4, "attempts": 1, "busy_s": 20.0, "samples": [[0, 3, 3, 0, 0]]}
    activity = {
        "00000": {"started_at": 0.0, "finished_at": 10.0, "endpoints": [job]},
        "00001": {"started_at": 5.0, "finished_at": 15.0, "endpoints": [job]},
        "00002": {
            "started_at": 3600.0,
            "finished_at": 3610.0,
            "endpoints": [job | {"busy_s": 30.0, "samples": [[3601, 4, 4, None, None]]}],
        },
    }
    (latest,) = endpoint_utilisation(activity)
    assert (latest["jobs"], latest["wall_s"], latest["max_in_flight"]) == (1, 10.0, 4)
    assert latest["utilisation"] == 30.0 / (4 * 10.0)
    assert latest["max_server_waiting"] is None
    del activity["00002"]
    (both,) = endpoint_utilisation(activity)
    assert (both["jobs"], both["wall_s"], both["utilisation"]) == (2, 15.0, 40.0 / 60.0)
