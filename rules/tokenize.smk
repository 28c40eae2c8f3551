rule tokenize_samples:
    input:
        samples=run_path("samples/{shard}.parquet"),
        target=get_target_dir(),
    output:
        tokens=run_path("tokens/{shard}.parquet"),
        counts=run_path("tokens/{shard}.counts.safetensors"),
        report=run_path("tokens/{shard}.report.json"),
    log:
        log_path("tokenize/{shard}.log"),
    benchmark:
        bench_path("tokenize/{shard}.tsv")
    conda:
        "../envs/cpu.yaml"
    threads: 1
    params:
        # Leaves out tokenize.draft_vocab_size: changing it rebuilds only the vocabulary.
        settings=get_tokenize_params_json(),
        code_version=code_version("tokenize"),
    script:
        "../scripts/tokenize.py"


rule build_draft_vocab:
    input:
        counts=expand(run_path("tokens/{shard}.counts.safetensors"), shard=SHARDS),
    output:
        vocab=run_path("vocab/draft_vocab.safetensors"),
        summary=run_path("vocab/draft_vocab.json"),
    log:
        log_path("vocab/build_draft_vocab.log"),
    conda:
        "../envs/cpu.yaml"
    threads: 1
    params:
        draft_vocab_size=config["tokenize"]["draft_vocab_size"],
        code_version=code_version("vocab"),
    script:
        "../scripts/build_draft_vocab.py"
