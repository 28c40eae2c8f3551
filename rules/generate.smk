rule generate_responses:
    input:
        prompts=run_path("prompts/{shard}.parquet"),
        probe=run_path("probe.json"),
    output:
        raw=run_path("raw/{shard}.parquet"),
    log:
        generate=log_path("generate/{shard}.log"),
        server=log_path("generate/{shard}.server.log"),
    benchmark:
        bench_path("generate/{shard}.tsv")
    conda:
        "../envs/cpu.yaml"
    threads: 1
    resources:
        endpoint_slots=1,
    params:
        # The journal lives outside the outputs so a failed or killed job never loses it.
        journal=lambda wc: run_path(f"journal/generate/{wc.shard}.jsonl"),
        # Only what shapes the request body reruns generation (not concurrency, timeouts, URLs).
        request=get_request_params_json(),
        code_version=code_version("generate"),
    script:
        "../scripts/generate.py"
