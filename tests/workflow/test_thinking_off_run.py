"""A run generated with thinking switched off, through real Snakemake up to its tokens: the small
demo with `target.chat_template_kwargs: {enable_thinking: false}`, served by the embedded demo
server, whose target answers content only after the template's closed think block. The probe
passes, validation keeps the answers without reasoning, the samples and tokens record thinking
off, and every token sequence is what the demo's template renders for the whole conversation
with the switch off (a drafter trained on it is trained for serving with thinking off)."""

from __future__ import annotations

import json
import shutil

import polars as pl
import pytest
from support.workflow import SMALL_DEMO, copy_workflow, job_logs, merged, snakemake

RUN = "thinking-off"
OFF = {"enable_thinking": False}


@pytest.mark.slow
def test_a_thinking_off_run_records_the_mode_and_the_templates_sequences(demo_target_dir, tmp_path):
    from transformers import AutoTokenizer

    workdir = copy_workflow(tmp_path / "wf")
    run_dir = workdir / "results" / RUN
    shutil.copytree(demo_target_dir, run_dir / "target")
    # Shards of 8 prompts, the first asked for (the second is held out): each prompt is an answer
    # to wait for.
    change = {
        "prompts": {"max_samples": 16, "shard_size": 8},
        "target": {"chat_template_kwargs": OFF},
    }
    config = {**merged(SMALL_DEMO, change), "run": RUN}
    result = snakemake(workdir, f"results/{RUN}/tokens/00000.report.json", config=config)
    assert result.returncode == 0, result.stderr[-4000:] + job_logs(workdir)

    probe = json.loads((run_dir / "probe.json").read_text())
    assert probe["endpoints"][0]["thinking_switch"] is False
    assert probe["answers_without_reasoning"] == probe["answers"]
    samples = pl.read_parquet(run_dir / "samples" / "00000.parquet")
    assert samples.height >= 6, json.loads((run_dir / "samples" / "00000.report.json").read_text())
    assert set(samples["thinking_switch"]) == {False} and set(samples["thinking"]) == {False}
    assert set(samples["reasoning"]) == {""} and set(samples["reasoning_field"]) == {"none"}

    tokens = pl.read_parquet(run_dir / "tokens" / "00000.parquet")
    report = json.loads((run_dir / "tokens" / "00000.report.json").read_text())
    assert tokens.height == samples.height and set(tokens["thinking"]) == {False}
    assert report["thinking"]["mode"] == "off" and report["server_ids_text_mismatch"] == 0
    assert report["token_sources"]["server"] == tokens.height
    assert report["agreement"]["share"] == 1.0, report["agreement"]["first_mismatches"]
    assert report["prompt_closes_think_block"] == tokens.height

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "target")
    by_id = dict(zip(samples["id"], zip(samples["messages"], samples["content"])))
    for sample_id, input_ids in zip(tokens["id"], tokens["input_ids"]):
        messages, content = by_id[sample_id]
        whole = tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": content}], tokenize=False, **OFF
        )
        # The template ends the turn with a newline the model does not write.
        expected = tokenizer(whole.removesuffix("\n"), add_special_tokens=False)["input_ids"]
        assert input_ids.to_list() == expected, (sample_id, whole)
