"""The run report: built from a synthetic finished run whose files have the layouts the stages
write (support/report_run.py); the report rule in real Snakemake and the demo run's report are
tests/workflow/test_report_rule.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.report_run import (
    DRAFT_VOCAB_SIZE,
    ENDPOINT,
    EVAL_METRICS,
    PER_SHARD,
    PNG_MAGIC,
    SHARDS,
    missing_references,
    page_sections,
    raw_frame,
    samples_frame,
    tokens_frame,
    write_json,
    write_run,
)

from eaglenest.formats.lengths import read_shard_lengths, write_shard_lengths
from eaglenest.stages.report.data import endpoint_utilisation
from eaglenest.stages.report.inputs import ReportInputError, RunFiles, load_run
from eaglenest.stages.report.report import PLOT_NAMES, build_report


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
    # every section drew its plot: the page embeds one image per plot, less the families' (one
    # family: no families section, as before there were families; its PNG is a card); the
    # choice's curve is drawn without report.device too, under its stated assumption
    assert text.count("data:image/png;base64,") == len(PLOT_NAMES) - 1
    assert "families" not in page_sections(page)
    assert page_sections(page)["training"] == "Training: loss and accuracy per TTT step"
    # Without report.device the summary chooses no family; this machine's figures name the K
    # that emits the most per target step here: K=3 emits 2.3 a 14 ms round (1.75 greedy
    # steps), K=7 2.7 a 21 ms round.
    summary = json.loads((page.parent / "summary.json").read_text())
    assert summary["choice"] is None and summary["why_none"].startswith("no serving device's")
    # ... and still draws the curve from the acceptance, under its stated assumption (v = 1).
    curve = summary["curve"]
    assert curve["device_ratio"] is None and curve["assumed"].startswith("no device timings")
    line = curve["families"]["eagle3"]
    per_k = summary["by_family"]["eagle3"]["per_k"]
    for r, k, rate in zip(curve["ratios"], line["ks"], line["tokens_per_target_step"], strict=True):
        at = {each: per_k[str(each)] for each in (3, 7)}
        rates = {
            each: f["emitted_per_round"] / (1 + f["drafter_forwards"] * r) for each, f in at.items()
        }
        assert rate == pytest.approx(rates[k]) == pytest.approx(max(rates.values()))
    assert (
        line["ks"][0] == 7 and line["ks"][-1] == 3
    )  # K falls as the drafter's forward weighs more
    fastest = summary["this_machine"]["fastest_here"]
    assert (fastest["family"], fastest["k"]) == ("eagle3", 3)
    assert fastest["tokens_per_target_step"] == pytest.approx(2.3 / 1.75)
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


def test_a_k_the_engine_cannot_serve_here_is_a_note_with_its_reason(tmp_path: Path):
    """A DFlash beside an MLA target on vLLM's CPU build: no engine figures, the reason shown."""
    run = write_run(tmp_path)
    reason = "an MLA target (DeepSeek-V3, Kimi-K2) on vLLM's CPU build is served only beside ..."
    engine = {"engine": "vllm", "per_k": {}, "by_depth": {}, "not_served": {"3": reason}}
    write_json(run / "eval" / "metrics.json", {**EVAL_METRICS, "engine": engine})
    page, figures = build(run)
    text = page.read_text()
    assert "K=3: not served by vllm here: an MLA target (DeepSeek-V3, Kimi-K2)" in text
    assert "acceptance length K=3 (vllm)" not in figures
    assert figures["acceptance length K=3 (simulated)"] == 2.41
    assert missing_references(page) == []


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


def test_a_parallel_familys_recipe_names_its_own_drafted_slots_not_the_ttt_keys():
    """P-EAGLE's and DFlash's settings leave EAGLE-3's TTT keys out (TrainSettings.of_family):
    their recipe says how their own slots are weighed and what they are drafted from."""
    from eaglenest.stages.report.training import recipe_rows

    settings = {"loss": "hard_cross_entropy", "lr": 0.003, "epochs": 2}
    for family, drafter, weights in (
        ("p_eagle", {"depths": 3}, "COD sampling"),
        ("dflash", {"gamma": 4.0, "block_size": 4}, "exp(-(j - 1) / 4)"),
    ):
        report = {"family": family, "ttt_steps": 3, "settings": settings, "drafter": drafter}
        rows = dict(recipe_rows(report))
        assert weights in rows["loss"] and "TTT" not in rows["loss"], rows["loss"]
        assert rows["drafted steps / their inputs"] == "3 / mask tokens"


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
