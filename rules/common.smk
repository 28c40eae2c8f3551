# Shared by every stage: config validation, paths of the run, code versions, params as JSON.
import os
import re
import sys
from pathlib import Path

# The library is importable without installing it (e.g. a cluster node with only the repo).
sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from eaglenest.common.planning_gc import (
    postpone_full_collections,
    resume_full_collections,
)

# Full garbage collections rescan the whole DAG as it grows and free nothing: postponed while
# Snakemake plans, back to normal once the run starts (see eaglenest.common.planning_gc).
_GC_THRESHOLDS = postpone_full_collections()


onstart:
    resume_full_collections(_GC_THRESHOLDS)
    # Before any job, now that the executor is known: train.nodes > 1 outside SLURM.
    check_executor(
        config, workflow.executor_plugin.name if workflow.executor_plugin else None
    )


from eaglenest.common.code_version import script_code_version as _script_code_version
from eaglenest.common.vllm_python import check_vllm_python
from eaglenest.common.config import (
    ConfigError,
    check_executor,
    read_config_file,
    validate_config,
)
from eaglenest.run.shards import (
    prepared_params_json,
    shard_ids,
    shard_params_json,
)
from eaglenest.run.split import split_shards
from eaglenest.stages.prompts.sources import local_source_files
from eaglenest.settings.demo_target import DemoTargetSettings
from eaglenest.settings.evaluate import EvaluateSettings, evaluate_job_settings_json
from eaglenest.settings.generate import GenerationClientSettings, RequestSettings
from eaglenest.settings.hidden_states import (
    HiddenSettings,
    HiddenStoreSettings,
    HiddenVerifySettings,
    TargetHeadSettings,
)
from eaglenest.settings.probe import ProbeClientSettings, ProbeSettings
from eaglenest.settings.prompts import PromptOptions
from eaglenest.settings.samples import SamplesSettings
from eaglenest.settings.families import family_of_suffix, family_suffix
from eaglenest.settings.train import TrainSettings, train_job_settings_json
from eaglenest.settings.vocab import VocabSettings
from eaglenest.settings.thinking import ThinkingSettings
from eaglenest.settings.vllm import VllmRuntime, capture_urls

try:
    # Snakemake's own loader keeps the last of a key written twice: each file read again.
    for _configfile in workflow.configfiles:
        read_config_file(_configfile)
    validate_config(config, Path(workflow.basedir) / "config" / "schema.yaml")
    # The machine's part, at every parse (a dry run too): the vLLM the planned jobs run.
    check_vllm_python(config)
except ValueError as err:  # ConfigError is one
    raise WorkflowError(str(err)) from None

RUN = config["run"]
DEMO = config["demo_target"]["enabled"]
# Fixed at parse time from max_samples and shard_size: more prompts only add shards.
SHARDS = shard_ids(config)
# Read once: the generate rule's params need it per shard (see shard_params_json).
PROMPT_OPTIONS = PromptOptions.from_config(config)


# What a drafter family's paths add to EAGLE-3's: "" for EAGLE-3 (drafter/, eval/, the paths it
# always had), _p_eagle, _dflash (eaglenest.settings.families.family_suffix). Only the families
# listed: no rule makes an unlisted family's files, so one taken out is never retrained (the
# report still reads what it left, rules/report.smk).
FAMILY_SUFFIXES = "|".join(
    family_suffix(family) for family in config["train"]["families"]
)


wildcard_constraints:
    shard=r"\d{5}",
    family_suffix=f"({FAMILY_SUFFIXES})",


# The demo target is built by the pipeline; its directory is the target for every later stage.
if DEMO and not config["target"]["path"]:
    config["target"]["path"] = f"results/{RUN}/target"

# The embedded demo server shapes the data only where it is the endpoint: in the scripts that send
# requests, when server.enabled. Elsewhere the import that starts it (endpoints.py imports
# server_process inside a function) is cut, and with it the server, its engine and its faults.
ENDPOINT_SCRIPTS = ("generate", "probe")
EMBEDDED_SERVER_ENTRY = "demo.server_process"
_CODE_VERSIONS = {}


def run_path(relative):
    """Path of an output of this run: results/{run}/<relative>."""
    return f"results/{RUN}/{relative}"


def get_log(rule, per_shard=False):
    """A job's log, found from its rule's name: logs/{run}/<rule>.log for a job that runs once per
    run, logs/{run}/<rule>/{shard}.log for one that runs per shard."""
    return f"logs/{RUN}/{rule}/{{shard}}.log" if per_shard else f"logs/{RUN}/{rule}.log"


def code_version(script):
    """The code version of scripts/<script>.py, the script a rule runs (the rule names its
    stem, and a test holds each to its own) - a hash of that script and of the library modules
    it imports, transitively (eaglenest.common.code_version.script_code_version)."""
    if script not in _CODE_VERSIONS:
        server_shapes_data = config["server"]["enabled"] and script in ENDPOINT_SCRIPTS
        exclude = [] if server_shapes_data else [EMBEDDED_SERVER_ENTRY]
        path = Path(workflow.basedir) / "scripts" / f"{script}.py"
        # Hashes the package that scripts will import, wherever it is installed.
        _CODE_VERSIONS[script] = _script_code_version(path, exclude)
    return _CODE_VERSIONS[script]


def settings_json(settings_class):
    """A stage's settings as a param: sorted JSON of the typed settings (eaglenest.settings) that
    its script hands to the library, so the values a job runs with are the values Snakemake
    compares to decide a rerun, and key order never reruns anything."""
    return settings_class.from_config(config).to_json()


def untracked(value):
    """A param that reaches the script but that Snakemake does not record, so a change of it
    reruns nothing: for what shapes no output (how a job reaches its endpoints, how hard it
    tries, the prompt options whose effect on a file other params already track).

    Snakemake leaves the params computed from a job's input, output, threads or resources out of
    its record (a change there shows up in those); a function of `input` is one. The workflow
    tests hold it to that (test_client_settings_rerun_nothing)."""
    return lambda wildcards, input: value


def get_server_logs(**logs):
    """A job's one named log plus, when the embedded server is the endpoint, the server's log
    beside it (<job log less .log>.server.log); a run against real endpoints has no such file to
    plan."""
    if config["server"]["enabled"]:
        (job_log,) = logs.values()
        logs["server"] = job_log.removesuffix(".log") + ".server.log"
    return logs


def get_generate_threads():
    """No core for a generate job that does HTTP only (~1 ms of CPU a request), so `--cores 2`
    does not limit how many shard jobs keep the endpoints full (`endpoint_slots` does); one when
    the job runs the embedded server, whose model computes on this machine."""
    return 1 if config["server"]["enabled"] else 0


def get_activity_log(shard="{shard}"):
    """A generate job's activity file (eaglenest.client.pool.activity_summary)."""
    return f"logs/{RUN}/generate_responses/{shard}.activity.json"


def get_target_dir():
    """The target directory as an input when the pipeline builds it, else nothing."""
    return run_path("target") if DEMO else []


def get_hidden_verification(ancient_only=False):
    """hidden/verify.json when hidden.verify_samples asks for the backend check (vLLM only). The
    captures wait for it, but only for its existence (`ancient_only`), so a rerun of the check
    alone recaptures nothing."""
    if config["hidden"]["backend"] != "vllm" or config["hidden"]["verify_samples"] == 0:
        return []
    path = run_path("hidden/verify.json")
    return ancient(path) if ancient_only else path


def get_hidden_states_gpus():
    """GPUs a hidden-state job claims: one for transformers, the tensor-parallel group for vLLM,
    none when capture servers (vllm.capture_urls, vllm.capture_url) hold them."""
    if config["hidden"]["backend"] == "vllm" and capture_urls(config["vllm"]):
        return 0
    if config["hidden"]["backend"] == "vllm":
        return config["vllm"]["tensor_parallel_size"]
    return 1


def get_evaluate_gpus():
    """GPUs the evaluation claims: vLLM's tensor-parallel group when it decodes there too."""
    if config["evaluate"]["engine"] == "vllm":
        return max(1, config["vllm"]["tensor_parallel_size"])
    return 1


def get_final_outputs():
    """What `all` asks for. Every per-shard file is reached through these (the report reads each
    shard's reports), so listing them here too would only add edges for the planner to resolve.
    """
    outputs = [run_path("probe.json"), run_path("vocab/draft_vocab.safetensors")]
    outputs += [run_path("hidden/target_head.safetensors")]
    for family in config["train"]["families"]:
        suffix = family_suffix(family)
        outputs += [run_path(f"drafter{suffix}/config.json")]
        outputs += [run_path(f"eval{suffix}/metrics.json")]
    outputs += [run_path("report/index.html")]
    return outputs


try:
    # Held out, trained on, stored and fetched: one split for the rules, `eaglenest plan` and
    # experiments/ (eaglenest.run.split).
    SPLIT = split_shards(config)
except ValueError as err:
    raise WorkflowError(str(err)) from None
TRAIN_SHARDS, EVAL_SHARDS = list(SPLIT.training), list(SPLIT.heldout)
STORED_SHARDS = list(SPLIT.stored)
STORE = HiddenStoreSettings.from_config(config)


def get_hidden_files(shards):
    """The hidden-state files of those of `shards` that are stored."""
    return expand(
        run_path("hidden/{shard}.safetensors"), shard=SPLIT.stored_among(shards)
    )


def get_pooled_tokens(shards):
    """The tokens shards of those of `shards` whose states the capture servers give."""
    return expand(run_path("tokens/{shard}.parquet"), shard=SPLIT.fetched_among(shards))


def get_store_params():
    """With states from the capture servers (hidden.store none/budget), how they are computed
    (tracked: a change reruns training, as a recaptured file would); nothing with files.
    """
    if not STORE.from_pool:
        return ""
    return settings_json(HiddenSettings)


def get_train_settings(train_settings):
    """The train rule's settings param of a family's job (its `{family_suffix}`): TrainSettings'
    JSON as it always was for EAGLE-3, with the family's own settings for another."""

    def settings(wildcards):
        family = family_of_suffix(wildcards.family_suffix)
        return train_job_settings_json(train_settings, config, family)

    return settings


def get_evaluate_settings(evaluate_settings):
    """The evaluate rule's settings param of a family's job: EvaluateSettings' JSON as it always
    was for EAGLE-3, with the K the family is measured at for another."""

    def settings(wildcards):
        family = family_of_suffix(wildcards.family_suffix)
        return evaluate_job_settings_json(evaluate_settings, config, family)

    return settings


def get_family(wildcards, output):
    """The family of a job's `{family_suffix}`: a function of its output, so a param Snakemake
    does not record (EAGLE-3's jobs keep the params they had; the paths already say it).
    """
    return family_of_suffix(wildcards.family_suffix)


def bench_path(relative):
    return f"benchmarks/{RUN}/{relative}"


# Standard evaluation sets (evaluate.sets, rules/eval_sets.smk).
from eaglenest.settings.eval_sets import (
    EvalSetLimits,
    SetDecodeSettings,
    eval_set_names,
    eval_set_settings,
)
from eaglenest.settings.evaluate import (
    CompareSettings,
    PlainSettings,
    compare_drafters,
)

EVAL_SETS = eval_set_names(config)


def get_eval_set_file(wildcards):
    """The set's local file, so editing it rereads the set."""
    return eval_set_settings(config, wildcards.set).path


def get_eval_set_settings(wildcards):
    """The set's entry of evaluate.sets as sorted JSON: editing one set rereads only it."""
    return eval_set_settings(config, wildcards.set).to_json()


def get_eval_set_outputs():
    """Every set's prompts and report ([] when evaluate.sets is empty: the rule never runs)."""
    return expand(
        run_path("eval_sets/{set}.{ext}"), set=EVAL_SETS, ext=["parquet", "report.json"]
    )


# The sets are decoded in vLLM only: without evaluate.engine vllm they are prepared, and neither
# an input nor a param of the evaluation (a run without them keeps its params).
DECODED_SETS = EVAL_SETS if config["evaluate"]["engine"] == "vllm" else []


PLAIN_DECODING = run_path("eval_plain/decoding.json")


def get_plain_decoding():
    """The run's plain decoding in vLLM (rule decode_plain), read by every evaluation there;
    nothing without evaluate.engine vllm, so no such job."""
    return PLAIN_DECODING if config["evaluate"]["engine"] == "vllm" else []


def get_decoded_sets():
    """The prepared sets the evaluation decodes ([] without sets or without the vLLM engine)."""
    return expand(run_path("eval_sets/{set}.parquet"), set=DECODED_SETS)


def get_set_decoding():
    """How the sets are rendered (SetDecodeSettings as JSON), "" when none is decoded."""
    return settings_json(SetDecodeSettings) if DECODED_SETS else ""


# Drafters trained elsewhere (evaluate.compare, rules/evaluate.smk): each its own job.
COMPARED = compare_drafters(config)
WEIGHT_SUFFIXES = ("safetensors", "bin", "pt")
# The names as a wildcard's pattern (a name may hold a dot); none matches nothing.
COMPARE_NAMES = "|".join(re.escape(name) for name in COMPARED) or "(?!)"


def get_compared_files(wildcards):
    """A compared drafter's config.json and weights, so replacing them decodes it again."""
    directory = Path(COMPARED[wildcards.compare])
    weights = [path for ext in WEIGHT_SUFFIXES for path in directory.glob(f"*.{ext}")]
    return [str(directory / "config.json"), *sorted(str(path) for path in weights)]


def get_compared_dir(wildcards):
    """The compared drafter's directory, as the config names it."""
    return COMPARED[wildcards.compare]


def get_compare_outputs():
    """Every compared drafter's figures ([] when evaluate.compare is empty)."""
    return expand(run_path("eval_compare/{compare}.json"), compare=list(COMPARED))
