rule prepare_prompts:
    input:
        sources=local_source_files(config),
    output:
        prompts=run_path("prompts/all.parquet"),
        report=run_path("prompts/report.json"),
    log:
        get_log("prepare_prompts"),
    conda:
        "../envs/eaglenest.yaml"
    threads: 1
    params:
        # What decides the ordered list (PromptOptions.list_settings): not max_samples or
        # shard_size, since raising them only adds shards.
        listing=prepared_params_json(PROMPT_OPTIONS),
        # The options the library reads, max_samples included (a list too short for it fails).
        prompts=untracked(PROMPT_OPTIONS.to_json()),
        code_version=code_version("prepare_prompts"),
    script:
        "../scripts/prepare_prompts.py"
