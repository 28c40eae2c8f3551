"""Acceptance by context depth (evaluate.depths): held-out samples cut at each depth (skipping,
and counting, those too short or whose prompt is past the depth), the table eval/metrics.json
keeps per K, its schema key, and the report's panel and table of it."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from eaglenest.stages.evaluate.depths import cut_at_depths, cut_sample, depth_table


def test_a_sample_is_cut_after_its_prompt_and_depth_generated_tokens():
    ids = list(range(100))
    assert cut_sample(ids, prompt_len=10, depth=0, continuation=20) == ids[:10]
    assert cut_sample(ids, prompt_len=10, depth=64, continuation=20) == ids[:74]
    assert cut_sample(ids, prompt_len=10, depth=70, continuation=20) == ids[:80]
    assert cut_sample(ids, prompt_len=10, depth=71, continuation=20) == "too_short"
    # A long prompt does not move the depth: generated tokens count, not the context's.
    assert cut_sample(ids, prompt_len=70, depth=10, continuation=20) == ids[:80]
    assert cut_sample(ids, prompt_len=95, depth=0, continuation=20) == "too_short"


def _tokens_file(path: Path, samples: list[tuple[int, int]]) -> Path:
    """A tokens shard of samples (length, prompt_len) whose ids are 1000 * row + position."""
    pl.DataFrame(
        {
            "input_ids": [[1000 * row + i for i in range(n)] for row, (n, _) in enumerate(samples)],
            "prompt_len": [p for _, p in samples],
        }
    ).write_parquet(path)
    return path


def test_cuts_take_the_first_samples_long_enough_per_depth_and_count_the_rest(tmp_path):
    first = _tokens_file(tmp_path / "00003.parquet", [(50, 5), (300, 5), (120, 90), (700, 8)])
    second = _tokens_file(tmp_path / "00004.parquet", [(600, 6), (40, 4), (900, 700)])
    cuts = cut_at_depths([first, second], depths=(0, 100, 512), per_depth=2, continuation=32)
    by_depth = {cut.depth: cut for cut in cuts}
    # Depth 0: each sample's own prompt; the first two samples long enough for 32 more tokens.
    assert [p[-1] for p in by_depth[0].prompts] == [4, 1004]
    assert by_depth[0].counts() == {"prompts": 2, "too_short": 0}
    # 100 generated tokens past each prompt (5 and 8 tokens).
    assert [len(p) for p in by_depth[100].prompts] == [105, 108]
    assert by_depth[100].prompts[0][0] == 1000  # the second sample of the first shard
    assert by_depth[100].counts() == {"prompts": 2, "too_short": 2}
    # 512: the 700-token sample of the first shard, then the second shard's 600-token one; the
    # 900-token sample is never reached (two prompts already).
    assert [p[0] for p in by_depth[512].prompts] == [3000, 0]
    assert by_depth[512].counts() == {"prompts": 2, "too_short": 3}
    deep = cut_at_depths([second], depths=(512,), per_depth=5, continuation=32)[0]
    # The 900-token sample's answer is 200 tokens (its prompt 700): too short for 512.
    assert deep.counts() == {"prompts": 1, "too_short": 2}


def test_the_table_has_a_row_per_depth_for_each_k_with_each_measurement():
    cuts = cut_at_depths([], depths=(0, 1024), per_depth=4, continuation=64)
    cuts[0].prompts = [[1, 2], [3, 4]]
    simulated = {"0": {"3": {"acceptance_length": 2.5, "positions": 90}}, "1024": {}}
    live = {"0": {"3": {"acceptance_length": 2.4, "rounds": 50, "tokens": 130, "prompts": 2,
                        "emitted_per_round": 2.56, "identical_to_greedy": True}}}  # fmt: skip
    engine = {"0": {"3": {"acceptance_length": 2.45, "rounds": 51, "tokens": 130, "prompts": 2,
                          "emitted_per_round": 2.51, "identical_to_plain": True}}}  # fmt: skip
    table = depth_table(cuts, (3,), 64, simulated, live, engine).to_json()
    assert table["depths"] == [0, 1024] and table["continuation_tokens"] == 64
    assert table["samples"]["0"]["prompts"] == 2
    rows = table["per_k"]["3"]
    assert [row["depth"] for row in rows] == [0, 1024]
    assert rows[0]["prompts"] == 2 and rows[1]["prompts"] == 0
    assert rows[0]["simulated"] == {"acceptance_length": 2.5, "positions": 90}
    assert rows[0]["live"]["rounds"] == 50 and rows[0]["live"]["identical_to_greedy"] is True
    assert rows[0]["engine"]["rounds"] == 51 and rows[0]["engine"]["identical_to_plain"] is True
    assert rows[1]["simulated"] is None and rows[1]["live"] is None and rows[1]["engine"] is None


def test_the_rows_keep_each_prompts_acceptance_for_the_reports_interval():
    cuts = cut_at_depths([], depths=(2048,), per_depth=2, continuation=64)
    cuts[0].prompts = [[1, 2], [3, 4]]
    live = {"acceptance_length": 2.5, "rounds": 30, "tokens": 80, "prompts": 2,
            "per_prompt": [2.0, 3.0], "rounds_per_prompt": [10, 20]}  # fmt: skip
    spread = {"ci95": [1.9, 2.9], "per_prompt": [1.8, None]}
    engine = {"acceptance_length": 2.4, "rounds": 31, "tokens": 80, "prompts": 2,
              "rounds_per_prompt": [31, 0], "spread": spread}  # fmt: skip
    table = depth_table(cuts, (3,), 64, {}, {"2048": {"3": live}}, {"2048": {"3": engine}})
    row = table.to_json()["per_k"]["3"][0]
    assert row["live"]["per_prompt"] == [2.0, 3.0] and row["live"]["rounds_per_prompt"] == [10, 20]
    assert row["engine"]["per_prompt"] == [1.8, None] and row["engine"]["ci95"] == [1.9, 2.9]
    assert row["engine"]["rounds_per_prompt"] == [31, 0]


def test_depths_are_a_config_key_of_the_evaluate_section():
    from eaglenest.common.config import ConfigError, settings_from_sections
    from eaglenest.settings.evaluate import EvaluateSettings

    assert settings_from_sections(EvaluateSettings).depths == ()
    settings = settings_from_sections(EvaluateSettings, evaluate={"depths": [0, 1024, 8192]})
    assert settings.depths == (0, 1024, 8192)
    with pytest.raises(ConfigError, match="depths"):
        settings_from_sections(EvaluateSettings, evaluate={"depths": [-1]})


def test_the_report_plots_and_tabulates_acceptance_by_depth():
    from eaglenest.stages.report.acceptance import depth_table_html
    from eaglenest.stages.report.figures import acceptance_figure

    cuts = cut_at_depths([], depths=(0, 512), per_depth=4, continuation=16)
    cuts[0].prompts = cuts[1].prompts = [[1]]
    row = {"acceptance_length": 2.0, "rounds": 8, "tokens": 16, "prompts": 1}
    per_depth = {"0": {"2": row}, "512": {"2": {**row, "acceptance_length": 1.5}}}
    sim = {d: {"2": {"acceptance_length": 2.2, "positions": 40}} for d in ("0", "512")}
    table = depth_table(cuts, (2,), 16, sim, per_depth, per_depth).to_json()
    metrics = {
        "ks": [2],
        "simulated": {"2": {"acceptance_length": 2.0, "conditional_acceptance": [0.8, 0.5]}},
        "by_depth": table,
    }
    figure = acceptance_figure(metrics, ["2"])
    panel = figure.axes[-1]
    assert panel.get_xlabel() == "generated depth (tokens)"
    lines = {line.get_label(): list(line.get_ydata()) for line in panel.get_lines()}
    assert lines["K=2 live"] == [2.0, 1.5] and lines["K=2 simulated"] == [2.2, 2.2]
    html = depth_table_html(table)
    assert "512" in html and "0 too short" in html


def test_the_decoded_window_is_the_drafts_a_decoding_from_the_cut_makes():
    """Simulated acceptance past a depth counts the whole rest of the answer; the window counts
    only the positions a decoding of `width` tokens from that depth's cut drafts from (c - 1 ..
    c + width - 2), in the samples the cut keeps: like with like beside live and engine."""
    import torch

    from eaglenest.stages.evaluate.simulated import decoded_window

    # Two samples: prompts of 3 and 6 tokens, lengths 20 and 12 (the second padded to 20).
    loss_mask = torch.zeros(2, 20, dtype=torch.bool)
    loss_mask[0, 3:20] = True
    loss_mask[1, 6:12] = True
    lengths = torch.tensor([20, 12])
    at_zero = decoded_window(loss_mask, lengths, depth=0, width=4)
    assert at_zero[0].nonzero().flatten().tolist() == [2, 3, 4, 5]  # cut 3: drafts from 2..5
    assert at_zero[1].nonzero().flatten().tolist() == [5, 6, 7, 8]  # cut 6
    at_eight = decoded_window(loss_mask, lengths, depth=8, width=5)
    assert at_eight[0].nonzero().flatten().tolist() == [10, 11, 12, 13, 14]  # cut 3 + 8
    assert not at_eight[1].any()  # an answer of 6 tokens: too short for 8 + 5
    assert decoded_window(loss_mask, lengths, depth=2, width=4)[1].nonzero().flatten().tolist() == [
        7,
        8,
        9,
        10,
    ]  # cut 6 + 2: depth counts the answer's tokens, not the prompt's


def test_the_depth_table_keeps_the_simulated_window_beside_the_figure_past_the_depth():
    cuts = cut_at_depths([], depths=(0,), per_depth=4, continuation=64)
    window = {"acceptance_length": 1.4, "positions": 60, "conditional_acceptance": [0.3]}
    simulated = {"0": {"3": {"acceptance_length": 3.5, "positions": 900, "window": window}}}
    row = depth_table(cuts, (3,), 64, simulated, None, None).to_json()["per_k"]["3"][0]
    assert row["simulated"] == {
        "acceptance_length": 3.5,
        "positions": 900,
        "window": {"acceptance_length": 1.4, "positions": 60},
    }
