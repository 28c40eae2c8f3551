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
        config=run_path("drafter/config.json"),
        weights=run_path("drafter/model.safetensors"),
        metrics=run_path("drafter/metrics.jsonl"),
        report=run_path("drafter/train_report.json"),
    log:
        get_log("train_drafter"),
    benchmark:
        bench_path("train/train_drafter.tsv")
    conda:
        "../envs/eaglenest.yaml"
    threads: 2
    resources:
        # Under SLURM: --nodes, and --gpus for all of them (profiles/slurm).
        gpu=config["train"]["gpus"] * config["train"]["nodes"],
        nodes=config["train"]["nodes"],
    params:
        settings=settings_json(TrainSettings),
        hidden=get_store_params(),
        # the capture servers (hidden.store none/budget): where, not what
        runtime=untracked(settings_json(VllmRuntime)),
        # Outside the outputs: Snakemake deletes those after a failure, the journal must survive.
        journal=run_path("journal/train"),
        code_version=code_version("train_drafter"),
    script:
        "../scripts/train_drafter.py"
