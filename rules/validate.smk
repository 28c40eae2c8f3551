rule validate_samples:
    input:
        raw=run_path("raw/{shard}.parquet"),
        prompts=run_path("prompts/{shard}.parquet"),
        probe=run_path("probe.json"),
    output:
        samples=run_path("samples/{shard}.parquet"),
        report=run_path("samples/{shard}.report.json"),
    log:
        log_path("validate/{shard}.log"),
    conda:
        "../envs/cpu.yaml"
    threads: 1
    params:
        settings=as_json("validation"),
        code_version=code_version("validate"),
    script:
        "../scripts/validate.py"
