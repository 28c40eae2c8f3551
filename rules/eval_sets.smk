# Standard evaluation sets (evaluate.sets): each set's local file read, checked and written as the
# run's evaluation prompts, which evaluate_drafter and evaluate_compare decode in vLLM (with
# evaluate.engine: vllm; docs/evaluate.md).
rule prepare_eval_set:
    input:
        source=get_eval_set_file,
        # its turns are checked against the target's positions, with its chat template
        target=get_target_dir(),
    output:
        prompts=run_path("eval_sets/{set}.parquet"),
        report=run_path("eval_sets/{set}.report.json"),
    log:
        get_log("prepare_eval_set/{set}"),
    wildcard_constraints:
        set="|".join(EVAL_SETS) or "(?!)",
    # ready from the start: checked against the target before any training job runs
    priority: 10
    conda:
        "../envs/eaglenest.yaml"
    threads: 1
    params:
        settings=get_eval_set_settings,
        limits=settings_json(EvalSetLimits),
        code_version=code_version("prepare_eval_set"),
    script:
        "../scripts/prepare_eval_set.py"
