rule build_demo_target:
    output:
        target=directory(run_path("target")),
    log:
        log_path("build_demo_target.log"),
    benchmark:
        bench_path("build_demo_target.tsv")
    conda:
        "../envs/cpu.yaml"
    threads: workflow.cores
    params:
        settings=as_json("demo_target"),
        code_version=code_version("demo_target"),
    script:
        "../scripts/build_demo_target.py"
