rule extract_hidden_states:
    input:
        tokens=run_path("tokens/{shard}.parquet"),
        target=get_target_dir(),
        verified=get_hidden_verification(ancient_only=True),
    output:
        hidden=run_path("hidden/{shard}.safetensors"),
        summary=run_path("hidden/{shard}.json"),
    log:
        get_log("extract_hidden_states", per_shard=True),
    benchmark:
        bench_path("hidden/{shard}.tsv")
    conda:
        "../envs/eaglenest.yaml"
    threads: 2
    resources:
        gpu=get_hidden_states_gpus(),
    params:
        settings=settings_json(HiddenSettings),
        # where vLLM runs (hidden.backend vllm): its interpreter, GPUs and memory, not what it
        # computes
        runtime=untracked(settings_json(VllmRuntime)),
        code_version=code_version("hidden_states"),
    script:
        "../scripts/hidden_states.py"


# hidden.verify_samples: vLLM against transformers on the first samples of the first shard, before
# any shard is captured (eaglenest.stages.hidden_states.verify.verify_backends).
rule verify_hidden_states:
    input:
        tokens=run_path(f"tokens/{SHARDS[0]}.parquet"),
        target=get_target_dir(),
    output:
        verify=run_path("hidden/verify.json"),
    log:
        get_log("verify_hidden_states"),
    conda:
        "../envs/eaglenest.yaml"
    threads: 2
    resources:
        gpu=get_hidden_states_gpus(),
    params:
        settings=settings_json(HiddenSettings),
        verify=settings_json(HiddenVerifySettings),
        runtime=untracked(settings_json(VllmRuntime)),
        code_version=code_version("verify_hidden_states"),
    script:
        "../scripts/verify_hidden_states.py"


rule save_target_head:
    input:
        target=get_target_dir(),
    output:
        head=run_path("hidden/target_head.safetensors"),
    log:
        get_log("save_target_head"),
    conda:
        "../envs/eaglenest.yaml"
    threads: 1
    params:
        settings=settings_json(TargetHeadSettings),
        code_version=code_version("save_target_head"),
    script:
        "../scripts/save_target_head.py"
