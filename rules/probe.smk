rule probe_endpoints:
    input:
        target=get_target_dir(),
    output:
        probe=run_path("probe.json"),
    params:
        settings=as_json("target", "server", "endpoints", "probe"),
        code_version=code_version("probe"),
    log:
        probe=log_path("probe_endpoints.log"),
        server=log_path("probe_endpoints.server.log"),
    threads: 1
    script:
        "../scripts/probe.py"
