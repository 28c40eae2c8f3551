# One job per shard validates the raw answers and tokenizes the samples that pass: both are cheap
# CPU work on the same rows, and as one job a shard costs the planner and a cluster one job, not
# two. Each step keeps its own report and its own part of the settings; the log has both.
rule prepare_samples:
    input:
        raw=run_path("raw/{shard}.parquet"),
        prompts=run_path("prompts/{shard}.parquet"),
        probe=run_path("probe.json"),
        target=get_target_dir(),
    output:
        samples=run_path("samples/{shard}.parquet"),
        samples_report=run_path("samples/{shard}.report.json"),
        tokens=run_path("tokens/{shard}.parquet"),
        counts=run_path("tokens/{shard}.counts.safetensors"),
        tokens_report=run_path("tokens/{shard}.report.json"),
        # What the report plots of each sample, so it need not read every sample's text.
        lengths=run_path("tokens/{shard}.lengths.parquet"),
    log:
        get_log("prepare_samples", per_shard=True),
    benchmark:
        bench_path("samples/{shard}.tsv")
    conda:
        "../envs/eaglenest.yaml"
    threads: 1
    params:
        # Validation's and tokenize's settings; tokenize.draft_vocab_size is not among them:
        # changing it rebuilds only the vocabulary.
        settings=settings_json(SamplesSettings),
        code_version=code_version("prepare_samples"),
    script:
        "../scripts/prepare_samples.py"
