rule build_demo_target:
    output:
        target=directory(run_path("target")),
    log:
        get_log("build_demo_target"),
    benchmark:
        bench_path("build_demo_target.tsv")
    conda:
        "../envs/eaglenest.yaml"
    # One: the model is tiny, and a second thread gains nothing (measured on 2 cores: 1.48
    # steps/s on one thread, 1.43 on two) while it slows every job beside it.
    threads: 1
    params:
        settings=settings_json(DemoTargetSettings),
        code_version=code_version("build_demo_target"),
    script:
        "../scripts/build_demo_target.py"
