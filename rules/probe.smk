rule probe_endpoints:
    input:
        target=get_target_dir(),
        # The probe asks the run's own first prompts: what the target will be asked in the run.
        prompts=run_path("prompts/all.parquet"),
    output:
        probe=run_path("probe.json"),
    log:
        **get_server_logs(probe=get_log("probe_endpoints")),
    conda:
        "../envs/eaglenest.yaml"
    threads: 1
    params:
        # What the probe asks and requires (and, when eaglenest serves the target, how its server
        # answers): a change reruns the probe, and every stage after it reads probe.json.
        settings=settings_json(ProbeSettings),
        # Where the endpoints are, their keys, the timeout: no reason to probe again.
        client=untracked(settings_json(ProbeClientSettings)),
        code_version=code_version("probe"),
    script:
        "../scripts/probe.py"
