"""The report's standard sets and compared drafters (stages/report/sets.py): a table per set with
every drafter's acceptance length and tokens per round in vLLM, over the set and per category,
the run's own drafter beside each one of evaluate.compare; the compared drafters beside the
run's on the held-out prompts and by depth; a drafter the CPU build did not serve said with its
reason; neither section in a run without sets or compared drafters (support/report_run.py's
synthetic run)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

from support.report_run import EVAL_METRICS, page_sections, write_family, write_json, write_run

from eaglenest.stages.evaluate.sets import NO_LIVE
from eaglenest.stages.report.inputs import RunFiles
from eaglenest.stages.report.report import build_report


def figures(acceptance: float, category: str | None) -> dict:
    return {
        "set": "mt_bench",
        "category": category,
        "temperature": 0.0,
        "acceptance_length": acceptance,
        "emitted_per_round": acceptance - 0.25,
        "rounds": 40,
        "tokens": 100,
        "prompts": 8,
        "identical_to_plain": True,
    }


def set_metrics(acceptance: float, sampled: bool = False) -> dict:
    """eval/metrics.json `sets` of one set (as sets.py writes it), K=3 only; `sampled`: with the
    figures sampled at 0.7 too (0.25 lower)."""
    metrics = {
        "mt_bench": {
            "set": "mt_bench",
            "prompts": 6,
            "turns": 8,
            "multi_turn_prompts": 2,
            "categories": {"arithmetic": 4, "lists": 2},
            "live": NO_LIVE,
            "temperature": 0.0,
            "plain_wall_s": 1.0,
            "engine": {
                "per_k": {"3": figures(acceptance, None)},
                "by_category": {
                    "arithmetic": {"3": figures(acceptance + 0.5, "arithmetic")},
                    "lists": {"3": figures(acceptance - 0.5, "lists")},
                },
            },
        }
    }
    if sampled:
        low = acceptance - 0.25
        metrics["mt_bench"]["sampled"] = {
            "0.7": {
                "per_k": {"3": {**figures(low, None), "temperature": 0.7}},
                "by_category": {
                    "lists": {"3": {**figures(low - 0.5, "lists"), "temperature": 0.7}}
                },
            }
        }
    return metrics


def engine(acceptance: float) -> dict:
    per_k = {"3": {**figures(acceptance, None), "set": "heldout", "speedup": 1.5}}
    return {"engine": "vllm", "per_k": per_k, "by_depth": {}, "not_served": {}}


def rows(text: str, section: str) -> list[list[str]]:
    start = text.index(f"<h2 id='{section}'>")
    end = text.find("<h2 ", start + 1)
    part = text[start : end if end > 0 else len(text)]
    return [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", part)]


def test_each_set_has_its_table_and_the_compared_drafters_stand_beside_the_run(tmp_path: Path):
    run = write_run(tmp_path)
    own = copy.deepcopy(EVAL_METRICS)
    own.update(engine=engine(2.5), sets=set_metrics(2.5, sampled=True))
    write_family(run, "eagle3", own)
    compared = {
        "name": "published",
        "drafter": "/models/published",
        "described": "speculators eagle3",
        "method": {"method": "eagle3"},
        "ks": [3],
        "engine": {**engine(2.0), "by_depth": {"512": {"3": figures(1.75, None)}}},
        "sets": set_metrics(2.0),
    }
    write_json(run / "eval_compare" / "published.json", compared)
    refused = {**compared, "name": "mla", "described": "speculators eagle3"}
    refused["engine"] = {**engine(2.0), "per_k": {}, "not_served": {"3": "no MLA drafter"}}
    refused.pop("sets")
    write_json(run / "eval_compare" / "mla.json", refused)
    page = run / "report" / "index.html"
    build_report(RunFiles.from_run_dir(run), page, run=run.name)
    sections = page_sections(page)
    assert sections["sets"].startswith("Standard sets")
    assert sections["compare"].startswith("Drafters compared")
    text = page.read_text()
    assert "<h3>mt_bench</h3>" in text
    sets = rows(text, "sets")
    assert ["EAGLE-3", "greedy", "all", "2.5", "2.25"] in sets
    assert ["EAGLE-3", "greedy", "arithmetic", "3", "2.75"] in sets
    assert ["EAGLE-3", "sampled at 0.7", "all", "2.25", "2"] in sets
    assert ["EAGLE-3", "sampled at 0.7", "lists", "1.75", "1.5"] in sets
    assert ["published (compared)", "greedy", "lists", "1.5", "1.25"] in sets
    assert ["published (compared)", "sampled at 0.7"] not in [row[:2] for row in sets]
    assert ["mla (compared)"] not in [row[:1] for row in sets]  # no sets decoded
    assert "6 prompts, 8 turns (2 prompts of several turns" in text
    assert "Decoded in vLLM only, greedy and sampled (seeded per prompt)" in text
    compare = rows(text, "compare")
    assert ["EAGLE-3", "this run&#x27;s", "2.5", "2.25"] in compare
    assert ["published (compared)", "speculators eagle3", "2", "1.75"] in compare
    assert ["published (compared)", "512", "1.75", "1.5"] in compare
    assert "mla (compared), K=3: not served here: no MLA drafter" in text


def test_a_run_without_sets_or_compared_drafters_has_neither_section(tmp_path: Path):
    run = write_run(tmp_path)
    page = run / "report" / "index.html"
    build_report(RunFiles.from_run_dir(run), page, run=run.name)
    sections = page_sections(page)
    assert "sets" not in sections and "compare" not in sections
