"""The example configs of real targets (config/examples/) as a user runs them: Snakemake reads
config/config.yaml (the embedded demo) and merges the example over it, so an example must set again
every demo value that does not fit a real target. Each example is dry-run with real Snakemake
(no model, no dataset, no server: an empty offline Hugging Face cache) for its plan, and its
jobs' params (the settings each script gets) are read from the same parse. The Kimi-K2.5 disk
figures of the README are checked against the hidden-state stage's own arithmetic, and rows shaped
as mlabonne/open-perfectblend's go through the prompts stage with the examples' settings."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from snakemake.utils import update_config
from workflow_helpers import REPO, copy_workflow, planned_jobs, snakemake

from eaglenest.common.config import validate_config
from eaglenest.formats.hidden_shard import bytes_per_token, tensor_specs
from eaglenest.settings.hidden import HiddenSettings
from eaglenest.stages.prompts import PromptOptions, prepare_prompts, read_prompts

EXAMPLES = REPO / "config" / "examples"
DEMO_CONFIG = REPO / "config" / "config.yaml"
DATASET = "mlabonne/open-perfectblend"

# Leaves of config/config.yaml an example may leave to the demo: they fit a real target as well.
# Kimi-K2.5's template reads `thinking`; the demo's `enable_thinking` rides along unread (a merge
# cannot drop a key).
INHERITED = {
    "demo_target.seed",
    "server.dialect",
    "evaluate.ks",
    "train.eval_shards",
    "target.chat_template_kwargs.enable_thinking",
}

# What each example is for (README "Kimi-K2.5 on a vLLM node" for the first).
EXPECTED = {
    "kimi-k2.5": {
        "shards": 50,
        "gpus": {"extract_hidden_states": 8, "train_drafter": 8, "evaluate_drafter": 8},
        "hidden": {
            "backend": "vllm",
            "dtype": "bf16",
            "engine": {
                "quantization": "compressed-tensors",
                "engine_args": {"language_model_only": True},
            },
        },
        "runtime": {"tensor_parallel_size": 8, "max_model_len": 40961},
        "live": False,
    },
    "qwen3-8b": {
        "shards": 20,
        "gpus": {"extract_hidden_states": 1, "train_drafter": 1, "evaluate_drafter": 1},
        "hidden": {"backend": "transformers", "dtype": "bf16", "engine": None},
        "runtime": {"tensor_parallel_size": 1, "max_model_len": None},
        "live": True,
    },
}

# Included after the Snakefile: writes the validated config and every rule's params, evaluated as
# a job of shard 00000 would get them, to $EAGLENEST_PLAN while Snakemake parses.
PLAN_DUMP = """\
include: "Snakefile"


import inspect as _inspect
import json as _json
import os as _os
from types import SimpleNamespace as _Wildcards


def _param(value):
    if not callable(value):
        return value
    # untracked(...) and per-shard params take the wildcards first, then input (unused here)
    extra = len(_inspect.signature(value).parameters) - 1
    return value(_Wildcards(shard="00000"), *[None] * extra)


with open(_os.environ["EAGLENEST_PLAN"], "w") as _out:
    _json.dump(
        {
            "config": config,
            "params": {
                r.name: {name: _param(value) for name, value in r.params.items()}
                for r in workflow.rules
            },
        },
        _out,
    )
"""


def merged_example(name: str) -> dict:
    """config/config.yaml with the example merged over it, as Snakemake does, validated."""
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    update_config(config, yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()))
    return validate_config(config)


def leaves(tree: dict, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out |= leaves(value, f"{path}.") if isinstance(value, dict) and value else {path}
    return out


def gpus_by_rule(result: subprocess.CompletedProcess) -> dict[str, set[int]]:
    """The `gpu` resource of every planned job, by rule, from a dry run's job listing."""
    gpus: dict[str, set[int]] = {}
    rule = None
    for line in result.stdout.splitlines():
        if match := re.match(r"^rule (\w+):$", line):
            rule = match.group(1)
        elif rule and (match := re.match(r"^\s+resources: .*\bgpu=(\d+)", line)):
            gpus.setdefault(rule, set()).add(int(match.group(1)))
    return gpus


@dataclasses.dataclass
class Plan:
    dry_run: subprocess.CompletedProcess  # `snakemake -n --configfile <example>`
    config: dict  # the validated config the workflow parsed
    params: dict[str, dict]  # rule -> param name -> value (JSON settings as dicts)

    def settings(self, rule: str, param: str = "settings") -> dict:
        return json.loads(self.params[rule][param])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    workdir = copy_workflow(tmp_path_factory.mktemp("examples"))
    (workdir / "plan_dump.smk").write_text(PLAN_DUMP)
    return workdir


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory) -> dict[str, str]:
    """An empty Hugging Face cache, offline: a dry run must need neither the model nor the data."""
    home = tmp_path_factory.mktemp("hf-home")
    return os.environ | {
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }


@pytest.fixture(scope="module")
def plans(workdir, offline_env, tmp_path_factory):
    cache: dict[str, Plan] = {}

    def plan(name: str) -> Plan:
        if name not in cache:
            configfile = f"config/examples/{name}.yaml"
            dry_run = snakemake(workdir, "-n", "--configfile", configfile, env=offline_env)
            assert dry_run.returncode == 0, dry_run.stdout[-3000:] + dry_run.stderr[-3000:]
            dump = tmp_path_factory.mktemp("plan") / f"{name}.json"
            env = offline_env | {"EAGLENEST_PLAN": str(dump)}
            parsed = snakemake(
                workdir, "all", "-n", "-s", "plan_dump.smk", "--configfile", configfile, env=env
            )
            assert parsed.returncode == 0, parsed.stdout[-3000:] + parsed.stderr[-3000:]
            assert planned_jobs(parsed) == planned_jobs(dry_run)  # the same plan, dumped
            raw = json.loads(dump.read_text())
            cache[name] = Plan(dry_run, raw["config"], raw["params"])
        return cache[name]

    yield plan
    # Nothing was read from or written to the Hugging Face cache.
    assert not [p for p in Path(offline_env["HF_HOME"]).rglob("*") if p.is_file()]


# --- with real Snakemake -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPECTED))
def test_example_plans_the_whole_job(name, plans):
    plan, expected = plans(name), EXPECTED[name]
    shards = expected["shards"]
    per_shard = ("generate_responses", "prepare_samples", "extract_hidden_states")
    once = ("prepare_prompts", "probe_endpoints", "build_draft_vocab", "save_target_head")
    once += ("train_drafter", "evaluate_drafter", "build_report", "all")
    assert planned_jobs(plan.dry_run) == {r: shards for r in per_shard} | {r: 1 for r in once}
    gpus = gpus_by_rule(plan.dry_run)
    assert {rule: gpus[rule] for rule in expected["gpus"]} == {
        rule: {n} for rule, n in expected["gpus"].items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPECTED))
def test_example_jobs_get_the_jobs_settings(name, plans):
    """The settings each job's script gets: prompts from the hub dataset, lengths for long
    reasoning, hidden states and evaluation as the example says, and no demo value left over."""
    plan, expected = plans(name), EXPECTED[name]
    prompts = json.loads(plan.params["prepare_prompts"]["prompts"])
    assert [prompts[k] for k in ("source", "split", "format")] == [DATASET, "train", "sharegpt"]
    assert prompts["max_samples"] == 10_000
    assert math.ceil(prompts["max_samples"] / prompts["shard_size"]) == expected["shards"]
    assert json.loads(plan.params["generate_responses"]["bounds"]) == {
        "start": 0,
        "stop": prompts["shard_size"],
    }
    request = plan.settings("generate_responses")
    assert request["max_tokens"] == 32768
    client = json.loads(plan.params["generate_responses"]["client"])
    # A 32K-token answer is never cut: streamed (vLLM) only an idle stream fails; not streamed
    # (SGLang drops token ids from streams) the hard limit leaves it room.
    assert client["timeout_s"] is None or client["timeout_s"] >= 3600
    assert client["timeout_s"] is not None or client["stream"] in ("auto", "always")
    tokenize = plan.settings("prepare_samples")["tokenize"]
    assert tokenize["max_length"] == 40960 >= request["max_tokens"] + 8192
    assert plan.settings("build_draft_vocab")["draft_vocab_size"] == 32000

    hidden = plan.settings("extract_hidden_states")
    assert {key: hidden[key] for key in expected["hidden"]} == expected["hidden"]
    runtime = plan.settings("extract_hidden_states", "runtime")
    assert {key: runtime[key] for key in expected["runtime"]} == expected["runtime"]
    assert runtime["python"] == ".venv-vllm/bin/python"
    if runtime["max_model_len"] is not None:  # capture sends each sample and generates one token
        assert runtime["max_model_len"] >= tokenize["max_length"] + 1

    evaluate = plan.settings("evaluate_drafter")
    assert (evaluate["engine"], evaluate["live"]) == ("vllm", expected["live"])
    assert plan.settings("evaluate_drafter", "runtime") == runtime
    train = plan.settings("train_drafter")
    assert (train["lr"], train["epochs"], train["max_batch_tokens"]) == (1.0e-4, 10, 16384)

    example = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    assert leaves(demo) - leaves(example) <= INHERITED, "demo values the example inherits"
    assert plan.config["prompts"]["source"] == DATASET


@pytest.mark.slow
def test_kimi_generation_runs_alone_while_the_server_holds_the_gpus(workdir, offline_env):
    """README step 1: with `--until prepare_samples` only the CPU jobs up to tokenization run,
    so the vLLM server can keep the node's GPUs until they are done."""
    result = snakemake(
        workdir,
        "-n",
        "--configfile",
        "config/examples/kimi-k2.5.yaml",
        "--until",
        "prepare_samples",
        env=offline_env,
    )
    assert planned_jobs(result) == {
        "prepare_prompts": 1,
        "probe_endpoints": 1,
        "generate_responses": 50,
        "prepare_samples": 50,
    }
    assert gpus_by_rule(result) == {}


# --- without Snakemake -------------------------------------------------------------------------


def test_kimi_hidden_state_disk_is_what_the_readme_says():
    """README: B = 3 aux x 7168 x 2 (bf16) + 7168 x 2 (final_hidden) + 8 (input_ids) + 1
    (loss_mask) bytes a token, 10,000 samples of 16,384 tokens; the stage's own arithmetic (the
    figure its log gives before capture) must agree."""
    readme = (REPO / "README.md").read_text()
    settings = HiddenSettings.from_config(merged_example("kimi-k2.5"))
    per_token = bytes_per_token(tensor_specs(1, 1, 7168, 3, settings))
    assert per_token == 3 * 7168 * 2 + 7168 * 2 + 8 + 1 == 57_353
    assert f"{per_token:,}" in readme
    assert f"{10_000 * 16_384 * per_token / 1e12:.1f} TB" in readme
    fp8 = bytes_per_token(tensor_specs(1, 1, 7168, 3, dataclasses.replace(settings, dtype="fp8")))
    assert f"{fp8:,}" in readme


def perfectblend_row(source: str, *turns: tuple[str, str]) -> dict:
    return {"conversations": [{"from": f, "value": v} for f, v in turns], "source": source}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_open_perfectblend_rows_become_prompts(name, tmp_path):
    """Rows shaped as mlabonne/open-perfectblend's (a `conversations` column of ShareGPT turns
    and a `source` column, in data/train-*.parquet) through the dataset path of the prompts stage,
    with the example's prompt settings; a local directory stands in for the hub name."""
    rows = [
        perfectblend_row(
            "slimorca",
            ("system", "You are helpful."),
            ("human", "Name a prime."),
            ("gpt", "7"),
            ("human", "Another?"),
            ("gpt", "11"),
        ),
        perfectblend_row("metamath", ("human", "What is 2 + 2?"), ("gpt", "4")),
        perfectblend_row("metamath", ("human", "What is 2 + 2?"), ("gpt", "Four.")),
        perfectblend_row("code", ("human", "x" * 16_001), ("gpt", "too long")),
    ]
    dataset = tmp_path / "open-perfectblend"
    (dataset / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), dataset / "data" / "train-00000-of-00001.parquet")
    options = PromptOptions.from_config(merged_example(name))
    assert (options.source, options.format) == (DATASET, "sharegpt")
    options = dataclasses.replace(
        options, source=str(dataset), cache_dir=str(tmp_path / "hf"), max_samples=2
    )
    report = prepare_prompts(options, tmp_path / "all.parquet", tmp_path / "report.json")
    messages = sorted(read_prompts(tmp_path / "all.parquet")["messages"].to_list(), key=len)
    assert messages == [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Another?"},
        ],
    ]
    skipped = {reason: n for reason, n in report["skipped"].items() if n}
    assert skipped == {"duplicate": 1, "too_long": 1}  # same prompt, other answer; > 16,000 chars
