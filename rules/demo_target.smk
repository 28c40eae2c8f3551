rule build_demo_target:
    output:
        target=directory(run_path("target")),
    params:
        settings=as_json("demo_target"),
        code_version=code_version("demo_target"),
    log:
        log_path("build_demo_target.log"),
    benchmark:
        bench_path("build_demo_target.tsv")
    threads: workflow.cores
    script:
        "../scripts/build_demo_target.py"
