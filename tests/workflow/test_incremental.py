"""What reruns after a change, as Snakemake plans it: one dry run per change in a copy of the
workdir of a finished run of the small demo (2 shards, the `finished_run_copy` fixture).

The expectations are data: one row per change, with the jobs a dry run must plan per rule. Config
changes are merged into SMALL_DEMO; code changes edit the workdir's copy of the library (which the
workflow hashes into each rule's `code_version` param) and are undone after the dry run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.workflow import SMALL_DEMO, copy_run, merged, planned_jobs, snakemake

pytestmark = pytest.mark.slow

N_SHARDS = 2  # SMALL_DEMO: 40 prompts in shards of 20
NEW_SHARDS = 2  # max_samples 40 -> 80

# ---- The stages after hidden states ------------------------------------------------------------
# Each runs once over all shards, so every change below that reaches the hidden states or the
# draft vocabulary reruns them once. Rules the workflow does not define yet are left out (see
# `later_stages`), so this table holds as the stages land; fix a count here if a stage differs.
LATER_STAGES = {"train_drafter": 1, "evaluate_drafter": 1, "build_report": 1}
# -------------------------------------------------------------------------------------------------

# Validation and tokenization are one job per shard (prepare_samples): either's change reruns it.
SAMPLES_ONWARD = {
    "prepare_samples": N_SHARDS,
    "build_draft_vocab": 1,
    "extract_hidden_states": N_SHARDS,
}
GENERATE_ONWARD = {"generate_responses": N_SHARDS, **SAMPLES_ONWARD}

# change id -> (config change merged into SMALL_DEMO, expected jobs per rule before LATER_STAGES)
CONFIG_CHANGES = {
    "more prompts: only the new shards, through every stage": (
        {"prompts": {"max_samples": 80}},
        {
            "generate_responses": NEW_SHARDS,
            "prepare_samples": NEW_SHARDS,
            "extract_hidden_states": NEW_SHARDS,
            "build_draft_vocab": 1,  # merges the counts of every shard
        },
    ),
    "temperature: generation onward, every shard": (
        {"generation": {"temperature": 0.3}},
        GENERATE_ONWARD,
    ),
    "top_p: generation onward, every shard": ({"generation": {"top_p": 0.9}}, GENERATE_ONWARD),
    "a validation threshold: validation onward": (
        {"validation": {"max_truncated_fraction": 0.4}},
        SAMPLES_ONWARD,
    ),
    "draft vocabulary size: the vocabulary only": (
        {"tokenize": {"draft_vocab_size": 200}},
        {"build_draft_vocab": 1},
    ),
    # The target head tracks only hidden.aux_layer_ids and where the target is
    # (TargetHeadSettings): how hidden states are stored does not read the checkpoint again.
    "hidden-state dtype: hidden states, not the target head": (
        {"hidden": {"dtype": "fp32"}},
        {"extract_hidden_states": N_SHARDS},
    ),
    # The served name: what the probe and generation ask for, the name the hidden states record;
    # not a reason to read the target head again (TargetSettings views).
    "the served name: the probe and generation onward, not the target head": (
        {"target": {"model": "another-name"}},
        {"probe_endpoints": 1, **GENERATE_ONWARD},
    ),
}

# change id -> (library module edited, how, expected jobs per rule before LATER_STAGES)
CODE_CHANGES = {
    "generate.py code: generation onward": ("stages/generate/generate.py", "code", GENERATE_ONWARD),
    "validate.py code: validation onward": ("stages/samples/validate.py", "code", SAMPLES_ONWARD),
    "hidden-state extraction code: hidden states only": (
        "stages/hidden_states/extract.py",
        "code",
        {"extract_hidden_states": N_SHARDS},
    ),
    "target-head format code: target head onward": (
        "formats/target_head.py",
        "code",
        {"save_target_head": 1},
    ),
    # reasoning.py is used by probe, generate, validate and tokenize: a comment or a docstring
    # there changes no behaviour, so nothing reruns.
    "reasoning.py comment and docstring: nothing": ("common/reasoning.py", "comment", {}),
}


@pytest.fixture(scope="module")
def later_stages(finished_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """LATER_STAGES less the rules the workflow does not define yet."""
    workdir = copy_run(finished_run, tmp_path_factory.mktemp("rules") / "workflow")
    listed = snakemake(workdir, "--list-rules", config=SMALL_DEMO)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    rules = set(listed.stdout.split())
    return {rule: count for rule, count in LATER_STAGES.items() if rule in rules}


def expected_jobs(expected: dict[str, int], later_stages: dict[str, int]) -> dict[str, int]:
    """The jobs of a row, plus the later stages and `all` whenever anything reruns."""
    return {**expected, **later_stages, "all": 1} if expected else {}


def edited_source(text: str, how: str) -> str:
    if how == "code":  # a new statement: the module's syntax tree changes
        return text + "\n_EDITED_BY_TEST_INCREMENTAL = 1\n"
    assert how == "comment" and text.startswith('"""'), "needs a module docstring to edit"
    return '"""(Edited.) ' + text[3:] + "\n# A comment added by test_incremental.\n"


@contextlib.contextmanager
def edited_module(workdir: Path, module: str, how: str) -> Iterator[None]:
    """The workdir's copy of a library module, edited for the duration of the block."""
    path = workdir / "src" / "eaglenest" / module
    original = path.read_text()
    path.write_text(edited_source(original, how))
    try:
        yield
    finally:
        path.write_text(original)


@pytest.mark.parametrize("change", CONFIG_CHANGES, ids=list(CONFIG_CHANGES))
def test_config_change_reruns_what_it_shapes(
    finished_run_copy: Path, later_stages: dict[str, int], change: str
):
    config_change, expected = CONFIG_CHANGES[change]
    result = snakemake(finished_run_copy, "-n", config=merged(SMALL_DEMO, config_change))
    assert planned_jobs(result) == expected_jobs(expected, later_stages)


@pytest.mark.parametrize("change", CODE_CHANGES, ids=list(CODE_CHANGES))
def test_library_edit_reruns_its_stage_onward(
    finished_run_copy: Path, later_stages: dict[str, int], change: str
):
    module, how, expected = CODE_CHANGES[change]
    with edited_module(finished_run_copy, module, how):
        result = snakemake(finished_run_copy, "-n", config=SMALL_DEMO)
    assert planned_jobs(result) == expected_jobs(expected, later_stages)


# Changes that touch only the stages after the hidden states: the full plan, nothing added.
TRAIN_ONWARD = {"train_drafter": 1, "evaluate_drafter": 1, "build_report": 1, "all": 1}
LATE_CHANGES = {
    "a training hyper-parameter: training and evaluation only": (
        {"train": {"lr": 1e-3}},
        None,
        TRAIN_ONWARD,
    ),
    "an evaluation setting: evaluation and report": (
        {"evaluate": {"ks": [2]}},
        None,
        {"evaluate_drafter": 1, "build_report": 1, "all": 1},
    ),
    "train.py code: training onward": ({}, "stages/train/train.py", TRAIN_ONWARD),
    "speculative.py code: evaluation onward": (
        {},
        "stages/evaluate/speculative.py",
        {"evaluate_drafter": 1, "build_report": 1, "all": 1},
    ),
    "report.py code: the report only": (
        {},
        "stages/report/report.py",
        {"build_report": 1, "all": 1},
    ),
}


@pytest.mark.parametrize("change", LATE_CHANGES, ids=list(LATE_CHANGES))
def test_late_stage_changes_rerun_only_those_stages(finished_run_copy: Path, change: str):
    config_change, module, expected = LATE_CHANGES[change]
    config = merged(SMALL_DEMO, config_change)
    with edited_module(finished_run_copy, module, "code") if module else contextlib.nullcontext():
        result = snakemake(finished_run_copy, "-n", config=config)
    assert planned_jobs(result) == expected
