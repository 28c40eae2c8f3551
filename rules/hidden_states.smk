rule extract_hidden_states:
    input:
        tokens=run_path("tokens/{shard}.parquet"),
        target=get_target_dir(),
    output:
        hidden=run_path("hidden/{shard}.safetensors"),
        summary=run_path("hidden/{shard}.json"),
    log:
        log_path("hidden/{shard}.log"),
    benchmark:
        bench_path("hidden/{shard}.tsv")
    conda:
        "../envs/cpu.yaml"
    threads: 2
    resources:
        gpu=1,
    params:
        settings=as_json("hidden"),
        target=get_hidden_target_json(),
        code_version=code_version("hidden"),
    script:
        "../scripts/hidden_states.py"


rule save_target_head:
    input:
        target=get_target_dir(),
    output:
        head=run_path("hidden/target_head.safetensors"),
    log:
        log_path("hidden/save_target_head.log"),
    conda:
        "../envs/cpu.yaml"
    threads: 1
    params:
        settings=as_json("hidden"),
        target=get_hidden_target_json(),
        code_version=code_version("target_head"),
    script:
        "../scripts/save_target_head.py"
