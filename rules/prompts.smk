rule prepare_prompts:
    input:
        sources=local_source_files(config),
    output:
        prompts=run_path("prompts/all.parquet"),
        report=run_path("prompts/report.json"),
    log:
        log_path("prompts/prepare.log"),
    conda:
        "../envs/cpu.yaml"
    threads: 1
    params:
        # Leaves out max_samples and shard_size: raising them only adds shards.
        settings=prepared_params_json(config),
        code_version=code_version("prompts"),
    script:
        "../scripts/prepare_prompts.py"
