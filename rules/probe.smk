rule probe_endpoints:
    input:
        target=get_target_dir(),
        # The probe asks the run's own first prompts: what the target will be asked in the run.
        prompts=run_path("prompts/all.parquet"),
    output:
        probe=run_path("probe.json"),
    log:
        **get_server_logs("probe_endpoints", probe=log_path("probe_endpoints.log")),
    conda:
        "../envs/cpu.yaml"
    threads: 1
    params:
        settings=as_json("target", "server", "endpoints", "probe"),
        extra_body=json.dumps(config["generation"]["extra_body"], sort_keys=True),
        code_version=code_version("probe"),
    script:
        "../scripts/probe.py"
