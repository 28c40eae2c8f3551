# Standard evaluation sets (evaluate.sets): each set's local file read, checked and written as the
# run's evaluation prompts. Not yet an input of evaluate_drafter (docs/evaluate.md).
from eaglenest.settings.eval_sets import eval_set_names, eval_set_settings

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


rule prepare_eval_set:
    input:
        source=get_eval_set_file,
    output:
        prompts=run_path("eval_sets/{set}.parquet"),
        report=run_path("eval_sets/{set}.report.json"),
    log:
        get_log("prepare_eval_set/{set}"),
    wildcard_constraints:
        set="|".join(EVAL_SETS) or "(?!)",
    conda:
        "../envs/eaglenest.yaml"
    threads: 1
    params:
        settings=get_eval_set_settings,
        code_version=code_version("prepare_eval_set"),
    script:
        "../scripts/prepare_eval_set.py"
