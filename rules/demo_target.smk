rule build_demo_target:
    output:
        target=directory(run_path("target")),
    log:
        get_log("build_demo_target"),
    benchmark:
        bench_path("build_demo_target.tsv")
    conda:
        "../envs/eaglenest.yaml"
    # Every core of this machine: Snakemake lowers it to --cores when the job runs. Unlike
    # workflow.cores it needs no --cores to parse (`snakemake --unlock`, -n, --list-rules).
    threads: os.cpu_count() or 1
    params:
        settings=settings_json(DemoTargetSettings),
        code_version=code_version("build_demo_target"),
    script:
        "../scripts/build_demo_target.py"
