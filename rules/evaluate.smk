rule evaluate_drafter:
    input:
        # One job per family of train.families: eval/ for EAGLE-3, eval_p_eagle/, eval_dflash/.
        drafter=run_path("drafter{family_suffix}/config.json"),
        weights=run_path("drafter{family_suffix}/model.safetensors"),
        hidden=get_hidden_files(EVAL_SHARDS),
        tokens=expand(run_path("tokens/{shard}.parquet"), shard=EVAL_SHARDS),
        head=run_path("hidden/target_head.safetensors"),
        vocab=run_path("vocab/draft_vocab.safetensors"),
        target=get_target_dir(),
    output:
        metrics=run_path("eval{family_suffix}/metrics.json"),
    log:
        get_log("evaluate_drafter{family_suffix}"),
    benchmark:
        bench_path("evaluate/evaluate_drafter{family_suffix}.tsv")
    conda:
        "../envs/eaglenest.yaml"
    threads: 2
    resources:
        gpu=get_evaluate_gpus(),
    params:
        settings=settings_json(EvaluateSettings),
        hidden=get_store_params(),
        runtime=untracked(settings_json(VllmRuntime)),
        family=get_family,
        code_version=code_version("evaluate_drafter"),
    script:
        "../scripts/evaluate_drafter.py"
