rule probe_endpoints:
    input:
        target=get_target_dir(),
    output:
        probe=run_path("probe.json"),
    log:
        **get_server_logs("probe_endpoints", probe=log_path("probe_endpoints.log")),
    conda:
        "../envs/cpu.yaml"
    threads: 1
    params:
        settings=as_json("target", "server", "endpoints", "probe"),
        code_version=code_version("probe"),
    script:
        "../scripts/probe.py"
