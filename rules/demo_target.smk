rule build_demo_target:
    output:
        target=directory(run_path("target")),
    log:
        get_log("build_demo_target"),
    benchmark:
        bench_path("build_demo_target.tsv")
    conda:
        "../envs/eaglenest.yaml"
    # Two: nothing of the demo runs before its target exists, so the build has the machine to
    # itself (make run on 2 cores: 259 s on two threads, 381 s on one); Snakemake lowers it to
    # --cores where fewer are given (each test worker's one).
    threads: 2
    params:
        settings=settings_json(DemoTargetSettings),
        code_version=code_version("build_demo_target"),
    script:
        "../scripts/build_demo_target.py"
