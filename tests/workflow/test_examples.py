"""The example configs of real targets (config/examples/) as a user runs them: with a --configfile
the Snakefile does not read config/config.yaml (the embedded demo), so an example is the whole
config over the schema's defaults, and no demo value reaches its jobs. Each example is dry-run
with real Snakemake (no model, no dataset, no server: an empty offline Hugging Face cache) for its
plan, and its jobs' params (the settings each script gets) are read from the same parse. The
examples in the stages without Snakemake (disk figures, open-perfectblend rows):
tests/house/test_example_configs.py."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from support.stand_in_vllm import stand_in_vllm_folder
from support.workflow import REPO, copy_workflow, planned_jobs, snakemake

from eaglenest.common.config import validate_config

EXAMPLES = REPO / "config" / "examples"
DEMO_CONFIG = REPO / "config" / "config.yaml"
DATASET = "mlabonne/open-perfectblend"

# What each example is for (docs/real-targets.md, "Kimi-K2.5 on a vLLM node", for the first).
EXPECTED = {
    "kimi-k2.5": {
        "shards": 50,
        # the capture server holds the 8 GPUs; its shard jobs only send requests and pack
        "gpus": {
            "extract_hidden_states": 0,
            "train_drafter": 8,
            "evaluate_drafter": 8,
            "decode_plain": 8,
        },
        "hidden": {
            "backend": "vllm",
            "dtype": "fp8",
            "target_signal": "topk",
            "top_k": 1,
            "engine": {
                "quantization": "compressed-tensors",
                "engine_args": {"language_model_only": True},
                "cpu_workarounds": True,  # a no-op on the node's GPUs
            },
        },
        "runtime": {
            "tensor_parallel_size": 8,
            "max_model_len": 40961,
            "capture_urls": ["http://127.0.0.1:8765"],
        },
        "live": False,
        # eagle3 (MLA) and dflash (Qwen3 attention beside the MLA target): a training and an
        # evaluation job each
        "families": 2,
    },
    "qwen3-8b": {
        "shards": 20,
        "gpus": {
            "extract_hidden_states": 1,
            "train_drafter": 1,
            "evaluate_drafter": 1,
            "decode_plain": 1,
        },
        "hidden": {
            "backend": "transformers",
            "dtype": "fp8",
            "target_signal": "topk",
            "top_k": 1,
            "engine": None,
        },
        "runtime": {"tensor_parallel_size": 1, "max_model_len": None, "capture_urls": []},
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
    # untracked(...), per-shard and per-family params take the wildcards first (shard 00000,
    # EAGLE-3), then input (unused here)
    extra = len(_inspect.signature(value).parameters) - 1
    return value(_Wildcards(shard="00000", family_suffix=""), *[None] * extra)


with open(_os.environ["EAGLENEST_PLAN"], "w") as _out:
    _json.dump(
        {
            "config": config,
            "params": {
                r.name: {name: _param(value) for name, value in r.params.items()}
                for r in workflow.rules
                # prepare_eval_set's are per set, and the examples list none
                if set(r.wildcard_names) <= {"shard", "family_suffix"}
            },
        },
        _out,
    )
"""


def example_config(name: str) -> dict:
    """The example over the schema's defaults, validated: what the workflow runs it with."""
    return validate_config(yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()))


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """{dotted path: value} of every leaf of a nested dict."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out |= leaves(value, f"{path}.") if isinstance(value, dict) and value else {path: value}
    return out


def demo_only_values(name: str) -> dict[str, object]:
    """Leaves of config/config.yaml that the schema's defaults do not have (at that value) and
    that the example does not set: what a run of the example must never get."""
    demo = leaves(yaml.safe_load(DEMO_CONFIG.read_text()))
    defaults = leaves(validate_config({}))
    example = leaves(yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()))
    return {
        path: value
        for path, value in demo.items()
        if path not in example and (path not in defaults or defaults[path] != value)
    }


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
    stand_in_vllm_folder(workdir)  # their vllm.python (.venv-vllm/bin/python) runs
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
    once += ("build_report", "all", "decode_plain")  # evaluate.engine vllm: one plain decoding
    per_family = {r: expected.get("families", 1) for r in ("train_drafter", "evaluate_drafter")}
    assert planned_jobs(plan.dry_run) == (
        {r: shards for r in per_shard} | {r: 1 for r in once} | per_family
    )
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

    assert plan.config["prompts"]["source"] == DATASET


def param_keys(value) -> set[str]:
    """Every key of every dict in a param (JSON settings parsed), at any depth."""
    if isinstance(value, str) and value[:1] in "{[":
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return set()
    if isinstance(value, dict):
        return set(value).union(*(param_keys(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(param_keys(v) for v in value))
    return set()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPECTED))
def test_no_demo_value_reaches_an_examples_jobs(name, plans):
    """The workflow parses the example over the schema's defaults and nothing else: every demo
    value the example does not set (the demo's target and server, its template switch, prompts,
    lengths, training) is absent from the parsed config, and no key the demo alone has appears
    in any param of any job."""
    plan = plans(name)
    demo_only = demo_only_values(name)
    assert {"server.enabled", "demo_target.enabled"} <= set(demo_only)
    assert plan.config == example_config(name)
    parsed = leaves(plan.config)
    reached = {p: v for p, v in demo_only.items() if p in parsed and parsed[p] == v}
    assert not reached, f"demo values in the {name} run"
    schema_keys = leaves(validate_config({})).keys()
    demo_keys = {p.rsplit(".", 1)[-1] for p in demo_only if p not in schema_keys}
    example_keys = {p.rsplit(".", 1)[-1] for p in leaves(plan.config)}
    in_jobs = {
        (rule, param, key)
        for rule, params in plan.params.items()
        for param, value in params.items()
        for key in param_keys(value) & (demo_keys - example_keys)
    }
    assert not in_jobs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("configfiles", "run"),
    [([], "demo"), (["config/config.yaml", "config/tests/demo-small.yaml"], "demo-small")],
)
def test_without_a_configfile_the_run_is_the_whole_demo(workdir, offline_env, configfiles, run):
    """A bare `snakemake` (what `make run` types) reads config/config.yaml: the demo target is
    built and served, every stage planned; a variant of the demo names it first and gets it."""
    args = ["--configfile", *configfiles] if configfiles else []
    result = snakemake(workdir, "-n", *args, env=offline_env)
    jobs = planned_jobs(result)
    assert jobs["build_demo_target"] == 1 and jobs["build_report"] == 1, jobs
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    shards = math.ceil(demo["prompts"]["max_samples"] / demo["prompts"]["shard_size"])
    if run == "demo":
        assert jobs["extract_hidden_states"] == shards
    assert f"results/{run}/report/" in result.stdout


@pytest.mark.slow
def test_kimi_requests_carry_its_templates_thinking_switch(plans):
    """Kimi-K2.5's chat template reads `thinking`; vLLM's kimi_k2 parser reads `enable_thinking`
    as well, so the demo's `enable_thinking` must not ride along: the probe's and the generation
    jobs' requests, and tokenize's rebuilds, carry `thinking` alone."""
    plan = plans("kimi-k2.5")
    assert demo_only_values("kimi-k2.5")["target.chat_template_kwargs.enable_thinking"] is True
    for rule, settings in (
        ("probe_endpoints", plan.settings("probe_endpoints")["target"]),
        ("generate_responses", plan.settings("generate_responses")["target"]),
        ("prepare_samples", plan.settings("prepare_samples")["tokenize"]["target"]),
    ):
        assert settings["chat_template_kwargs"] == {"thinking": True}, rule


@pytest.mark.slow
def test_kimi_generation_runs_alone_while_the_server_holds_the_gpus(workdir, offline_env):
    """docs/real-targets.md, Kimi-K2.5 step 1: with `--until prepare_samples` only the CPU jobs up to tokenization run,
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


@pytest.mark.slow
def test_kimi_capture_runs_through_the_server_and_claims_no_gpus(workdir, offline_env):
    """docs/real-targets.md, Kimi-K2.5 step 2: under `eaglenest serve-capture`, `--until extract_hidden_states` plans the
    50 capture jobs (and what they need), none of them claiming the GPUs the server holds, and
    nothing that needs them after it (training, evaluation)."""
    result = snakemake(
        workdir, "-n", "--configfile", "config/examples/kimi-k2.5.yaml",
        "--until", "extract_hidden_states", env=offline_env,
    )  # fmt: skip
    assert planned_jobs(result)["extract_hidden_states"] == 50
    assert gpus_by_rule(result) == {"extract_hidden_states": {0}}
