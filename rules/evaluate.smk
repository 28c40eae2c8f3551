rule evaluate_drafter:
    input:
        drafter=run_path("drafter/config.json"),
        weights=run_path("drafter/model.safetensors"),
        hidden=get_hidden_files(EVAL_SHARDS),
        tokens=expand(run_path("tokens/{shard}.parquet"), shard=EVAL_SHARDS),
        head=run_path("hidden/target_head.safetensors"),
        vocab=run_path("vocab/draft_vocab.safetensors"),
        target=get_target_dir(),
    output:
        metrics=run_path("eval/metrics.json"),
    log:
        get_log("evaluate_drafter"),
    benchmark:
        bench_path("evaluate/evaluate_drafter.tsv")
    conda:
        "../envs/eaglenest.yaml"
    threads: 2
    resources:
        gpu=get_evaluate_gpus(),
    params:
        settings=settings_json(EvaluateSettings),
        hidden=get_store_params(),
        runtime=untracked(settings_json(VllmRuntime)),
        code_version=code_version("evaluate_drafter"),
    script:
        "../scripts/evaluate_drafter.py"
