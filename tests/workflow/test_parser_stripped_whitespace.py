"""Whitespace a server's reasoning parser strips from the reasoning is understood by tokenize.

vLLM 0.32's kimi_k2 parser (and the others of its parser engine that keep
strip_trailing_reasoning_whitespace on) rstrips the reasoning text, so the server's ids hold
`...\\n</think>` while the text holds `...</think>`. Tokenize once logged `server_ids_text_mismatch`
for every sample and the report showed 0% server/rebuild agreement. Now the ids stay the truth,
the stripped whitespace is counted apart from real mismatches and said once per shard, the
agreement is computed with it put back, and a rebuild without ids for such a parser says once per
shard what it cannot recover.

End to end through real Snakemake: the demo server in its `vllm_kimi_k2` dialect (the demo
target writes `<think>\\n...\\n</think>`, so the parser strips a newline from every reasoning),
then the samples stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.workflow import SMALL_DEMO, copy_workflow, job_logs, merged, snakemake

from eaglenest.stages.samples.server_ids import server_text_check


def test_server_text_check_finds_the_whitespace_a_parser_stripped():
    decoded = "<think>\nadd 2 and 3\n</think>\n\n5<|im_end|>"
    assert server_text_check(decoded, "\nadd 2 and 3\n", "</think>", "\n\n5") == ""
    assert server_text_check(decoded, "\nadd 2 and 3", "</think>", "\n\n5") == "\n"
    assert server_text_check(decoded, "\nadd 2 and 4", "</think>", "\n\n5") is None
    assert server_text_check(decoded, "\nadd 2", "</think>", "\n\n5") is None


def run_samples(workdir: Path, target_dir: Path, run: str, **sections) -> tuple[dict, str]:
    """The first shard's tokens report and job log of the small demo under `run`, served by the
    demo server with `sections` over it."""
    shutil.copytree(target_dir, workdir / "results" / run / "target")
    # Shards of 8 prompts (the first is asked for): every sample is checked alike, each prompt is
    # an answer to wait for.
    few = {"prompts": {"max_samples": 16, "shard_size": 8}}
    config = {**merged(merged(SMALL_DEMO, few), sections), "run": run}
    report = f"results/{run}/tokens/00000.report.json"
    result = snakemake(workdir, report, config=config)
    assert result.returncode == 0, result.stderr[-4000:] + job_logs(workdir)
    log = (workdir / f"logs/{run}/prepare_samples/00000.log").read_text()
    return json.loads((workdir / report).read_text()), log


@pytest.mark.slow
def test_kimi_k2_stripping_is_counted_once_not_a_mismatch_per_sample(demo_target_dir, tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    server = {"enabled": True, "dialect": "vllm_kimi_k2"}
    report, log = run_samples(workdir, demo_target_dir, "kimi-ids", server=server)
    written = report["written"]
    assert written > 0 and report["token_sources"]["server"] == written
    assert report["server_ids_text_mismatch"] == 0, log
    # The demo target ends every reasoning with "\n", which the parser stripped.
    assert report["parser_stripped_whitespace"] == report["samples"] > 0, report
    assert report["stripped_whitespace"] == {repr("\n"): report["samples"]}
    # The rebuild, with the stripped newline put back, agrees with the server's ids.
    assert report["agreement"]["compared"] == written
    assert report["agreement"]["share"] == 1.0, report["agreement"]["first_mismatches"]
    assert "does not hold its reasoning" not in log
    assert log.count("stripped trailing whitespace") == 1, log

    # Without token ids the rebuild cannot recover it: said once for the shard.
    no_ids = {**server, "token_ids": False}
    target = {"reasoning_parser": "kimi_k2"}
    probe = {"require_token_ids": False}
    report, log = run_samples(
        workdir, demo_target_dir, "kimi-no-ids", server=no_ids, target=target, probe=probe
    )
    assert report["token_sources"]["rebuilt"] == report["written"] > 0
    assert report["rebuilt_without_stripped_whitespace"] == report["written"]
    assert report["reasoning_parser"] == "kimi_k2"
    assert log.count("which a rebuild cannot recover") == 1, log
