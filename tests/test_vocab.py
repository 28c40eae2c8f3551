"""The draft vocabulary: top-N by loss-masked frequency, specials kept, d2t/t2d as EAGLE-3 reads
them, coverage; and the tokenize + vocab rules in real Snakemake."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from safetensors.numpy import load_file
from support.frames import prompt_frame, raw_row
from support.tiny_tokenizer import make_tokenizer
from support.workflow import planned_jobs

from eaglenest.common.io import read_json, write_json
from eaglenest.formats.raw import RAW_SCHEMA
from eaglenest.formats.token_counts import (
    TokenCounts,
    merge_token_counts,
    read_token_counts,
    write_token_counts,
)
from eaglenest.settings.vocab import VocabSettings
from eaglenest.stages.vocab import (
    VocabError,
    build_draft_vocab,
    coverage,
    draft_mapping,
    select_draft_vocab,
)
from eaglenest.target_model.tokenizer import think_token_ids

REPO = Path(__file__).resolve().parents[1]


def counts_of(values: dict[int, int], vocab_size: int, special_ids=(), names=None) -> TokenCounts:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for token_id, count in values.items():
        counts[token_id] = count
    return TokenCounts(counts, np.asarray(sorted(special_ids), dtype=np.int64), names or {})


def test_top_n_by_frequency_sorted_by_target_id_ties_to_the_lower_id():
    counts = counts_of({7: 50, 3: 10, 9: 10, 1: 40, 5: 2}, vocab_size=12)
    assert select_draft_vocab(counts, 3).tolist() == [1, 3, 7]  # 3 and 9 tie: 3 wins
    assert select_draft_vocab(counts, 5).tolist() == [1, 3, 5, 7, 9]
    # Room left after every id seen: the lowest unseen ids fill it.
    assert select_draft_vocab(counts, 7).tolist() == [0, 1, 2, 3, 5, 7, 9]


def test_special_tokens_used_in_completions_are_always_kept():
    # 10 (</think>) and 11 (end of turn) are rare; 8 is special but never used.
    counts = counts_of({1: 90, 2: 80, 3: 70, 4: 60, 10: 1, 11: 1}, 12, special_ids=(8, 10, 11))
    assert select_draft_vocab(counts, 3).tolist() == [1, 10, 11]
    with pytest.raises(VocabError, match="smaller than the 2 special tokens"):
        select_draft_vocab(counts, 1)


def test_size_is_capped_at_the_target_vocabulary():
    counts = counts_of({0: 1, 2: 3}, vocab_size=4)
    assert select_draft_vocab(counts, 32000).tolist() == [0, 1, 2, 3]


def test_d2t_and_t2d_are_consistent():
    rng = np.random.default_rng(0)
    counts = counts_of(dict(enumerate(rng.integers(0, 1000, 500).tolist())), 500, (498, 499))
    draft_to_target = select_draft_vocab(counts, 64)
    mapping = draft_mapping(draft_to_target, 500)
    d2t, t2d = mapping["d2t"], mapping["t2d"]
    assert d2t.dtype == np.int64 and d2t.shape == (64,)
    assert t2d.dtype == np.bool_ and t2d.shape == (500,) and t2d.sum() == 64
    draft_ids = np.arange(64)
    assert t2d[d2t + draft_ids].all()  # t2d[d2t[i] + i] for every i
    assert np.array_equal(d2t + draft_ids, draft_to_target)
    assert np.all(np.diff(d2t) >= 0)  # sorted by target id: offsets never decrease
    assert np.array_equal(np.flatnonzero(t2d), draft_to_target)


def test_coverage_on_a_hand_made_example():
    counts = counts_of({0: 5, 1: 3, 2: 2}, vocab_size=4)  # 10 loss tokens
    assert coverage(counts.counts, np.array([0, 1])) == pytest.approx(0.8)
    assert coverage(counts.counts, np.array([2, 3])) == pytest.approx(0.2)
    assert coverage(np.zeros(4, dtype=np.int64), np.array([0])) == 0.0


def test_counts_round_trip_merge_and_build(tmp_path):
    names = {10: "</think>", 11: "<|im_end|>"}
    shard_a = counts_of({1: 5, 2: 1, 10: 1, 11: 1}, 12, (8, 10, 11), names)
    shard_b = counts_of({1: 1, 3: 4, 10: 1, 11: 1}, 12, (8, 10, 11), names)
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    write_token_counts(paths[0], shard_a, "00000")
    write_token_counts(paths[1], shard_b, "00001")
    back = read_token_counts(paths[0])
    assert np.array_equal(back.counts, shard_a.counts) and back.special_tokens == names
    merged = merge_token_counts(paths)
    assert merged.counts.tolist() == [0, 6, 1, 4, 0, 0, 0, 0, 0, 0, 2, 2]

    summary = build_draft_vocab(
        paths, tmp_path / "v.safetensors", tmp_path / "v.json", VocabSettings(draft_vocab_size=4)
    )
    tensors = load_file(tmp_path / "v.safetensors")
    assert tensors["draft_to_target"].tolist() == [1, 3, 10, 11]
    assert tensors["d2t"].tolist() == [1, 2, 8, 8]
    assert tensors["t2d"].tolist() == [i in (1, 3, 10, 11) for i in range(12)]
    assert tensors["token_counts"].tolist() == merged.counts.tolist()
    assert summary["coverage"] == pytest.approx(14 / 15)
    assert summary["special_tokens_kept"] == {"10": "</think>", "11": "<|im_end|>"}
    assert read_json(tmp_path / "v.json") == json.loads(json.dumps(summary))

    other = counts_of({1: 1}, 13, (8, 10, 11))
    write_token_counts(tmp_path / "c.safetensors", other)
    with pytest.raises(VocabError, match="different target vocabularies"):
        merge_token_counts([paths[0], tmp_path / "c.safetensors"])


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "snakemake", "--cores", "1", "--configfile=c.yaml"]
    return subprocess.run(
        [*command, *args], cwd=workdir, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.slow
def test_samples_and_vocab_rules_in_snakemake(tmp_path):
    """Only the rules from raw answers on run (prepare_samples: validate + tokenize, then the
    vocabulary), on raw shards made here; changing draft_vocab_size reruns only the vocabulary."""
    for name in ("Snakefile", "rules", "scripts", "config", "profiles", "envs"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, tmp_path / name)
    tokenizer_dir = make_tokenizer(tmp_path / "tokenizer")
    config = {
        "run": "t",
        "target": {"path": str(tokenizer_dir), "chat_template_kwargs": {}},
        "demo_target": {"enabled": False},
        "server": {"enabled": False},
        "endpoints": [{"url": "http://127.0.0.1:9"}],
        "prompts": {"max_samples": 4, "shard_size": 2},
        "tokenize": {"draft_vocab_size": 64},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "results" / "t"
    # A server without token ids: validation keeps the rows and tokenize rebuilds the ids.
    write_json(
        run_dir / "probe.json",
        {
            "reasoning_field": "reasoning",
            "token_ids": {"supported": False},
            "think_token_ids": think_token_ids(str(tokenizer_dir)),  # what the probe writes
        },
    )
    for shard in ("00000", "00001"):
        prompts = prompt_frame(2, tag=shard)
        answers = [
            raw_row(
                i,
                reasoning=f"\nadd {k}\n",
                content=f"\n\n{k}",
                completion_token_ids=None,
                prompt_token_ids=None,
                token_layout=None,
            )
            for k, i in enumerate(prompts["id"].to_list())
        ]
        for stage, frame in (
            ("prompts", prompts),
            ("raw", pl.DataFrame(answers, schema=RAW_SCHEMA)),
        ):
            (run_dir / stage).mkdir(parents=True, exist_ok=True)
            frame.write_parquet(run_dir / stage / f"{shard}.parquet")
    rules = ("--allowed-rules", "prepare_samples", "build_draft_vocab")
    target = "results/t/vocab/draft_vocab.safetensors"
    result = snakemake(tmp_path, target, *rules)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert read_json(run_dir / "samples/00001.report.json")["kept"] == 2
    report = read_json(run_dir / "tokens/00001.report.json")
    assert report["written"] == 2 and report["token_sources"] == {"server": 0, "rebuilt": 2}
    summary = read_json(run_dir / "vocab/draft_vocab.json")
    assert summary["draft_vocab_size"] == 64 and summary["shards"] == 2
    assert summary["coverage"] == 1.0  # 4 short answers use fewer than 64 distinct ids
    # One log per job, each step's lines named by its module.
    log = (tmp_path / "logs/t/prepare_samples/00000.log").read_text()
    assert "eaglenest.stages.samples.validate" in log and "eaglenest.stages.samples" in log
    assert log.count("tokens/s") == 1

    config["tokenize"]["draft_vocab_size"] = 32
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    dry = snakemake(tmp_path, target, *rules, "-n")
    assert planned_jobs(dry) == {"build_draft_vocab": 1}
