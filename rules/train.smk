rule train_drafter:
    input:
        # hidden.store: each shard's states are a file, or asked of the capture servers for its
        # tokens (get_hidden_files, get_pooled_tokens); shard order is kept.
        train=get_hidden_files(TRAIN_SHARDS),
        pooled=get_pooled_tokens(TRAIN_SHARDS),
        heldout=get_hidden_files(EVAL_SHARDS),
        heldout_pooled=get_pooled_tokens(EVAL_SHARDS),
        head=run_path("hidden/target_head.safetensors"),
        vocab=run_path("vocab/draft_vocab.safetensors"),
        target=get_target_dir(),
    output:
        # One job per family of train.families, from the same shards: drafter/ for EAGLE-3,
        # drafter_p_eagle/, drafter_dflash/ for the others (family_suffix).
        config=run_path("drafter{family_suffix}/config.json"),
        weights=run_path("drafter{family_suffix}/model.safetensors"),
        metrics=run_path("drafter{family_suffix}/metrics.jsonl"),
        report=run_path("drafter{family_suffix}/train_report.json"),
    log:
        get_log("train_drafter{family_suffix}"),
    benchmark:
        bench_path("train/train_drafter{family_suffix}.tsv")
    conda:
        "../envs/eaglenest.yaml"
    threads: 2
    resources:
        # Under SLURM: --nodes, and --gpus for all of them (profiles/slurm).
        gpu=config["train"]["gpus"] * config["train"]["nodes"],
        nodes=config["train"]["nodes"],
    params:
        settings=get_train_settings(settings_json(TrainSettings)),
        hidden=get_store_params(),
        # the capture servers (hidden.store none/budget): where, not what
        runtime=untracked(settings_json(VllmRuntime)),
        # Outside the outputs: Snakemake deletes those after a failure, the journal must survive.
        journal=run_path("journal/train{family_suffix}"),
        code_version=code_version("train_drafter"),
    script:
        "../scripts/train_drafter.py"
