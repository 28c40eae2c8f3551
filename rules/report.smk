# The run report: results/{run}/report/index.html (self-contained), one PNG per plot, each in
# `snakemake --report` with its caption from report/, and report/summary.json (the drafter family
# chosen). Reads every stage's files; see eaglenest.stages.report (report.py builds it from
# inputs, data, figures, sections, choice and page).
from eaglenest.settings.report import ReportSettings
from eaglenest.stages.report.family_files import report_family_files

# Of the families train.families lists, and of any other evaluated already: a family taken out
# keeps its files and its place, so the report's inputs never shrink and taking one out reruns
# nothing (Snakemake reruns a job whose set of inputs changed); one added is a new input.
REPORT_FAMILY_FILES = report_family_files(config["train"]["families"], run_path(""))


rule build_report:
    input:
        prompts_report=run_path("prompts/report.json"),
        probe=run_path("probe.json"),
        raw=expand(run_path("raw/{shard}.parquet"), shard=SHARDS),
        samples_reports=expand(run_path("samples/{shard}.report.json"), shard=SHARDS),
        tokens_reports=expand(run_path("tokens/{shard}.report.json"), shard=SHARDS),
        lengths=expand(run_path("tokens/{shard}.lengths.parquet"), shard=SHARDS),
        hidden_summaries=expand(run_path("hidden/{shard}.json"), shard=STORED_SHARDS),
        draft_vocab=run_path("vocab/draft_vocab.json"),
        # Per family: drafter/ and eval/ for EAGLE-3, drafter_p_eagle/ ... for the others.
        train_metrics=REPORT_FAMILY_FILES["train_metrics"],
        train_report=REPORT_FAMILY_FILES["train_report"],
        eval_metrics=REPORT_FAMILY_FILES["eval_metrics"],
        drafter_config=REPORT_FAMILY_FILES["drafter_config"],
        # evaluate.compare: the drafters trained elsewhere, beside the run's own
        compare=get_compare_outputs(),
        hidden_verify=get_hidden_verification(),
    output:
        html=run_path("report/index.html"),
        summary=run_path("report/summary.json"),
        funnel=report(
            run_path("report/funnel.png"),
            caption="../report/funnel.rst",
            category="1. Data",
        ),
        lengths=report(
            run_path("report/lengths.png"),
            caption="../report/lengths.rst",
            category="1. Data",
        ),
        generation=report(
            run_path("report/generation.png"),
            caption="../report/generation.rst",
            category="2. Generation",
        ),
        hidden_states=report(
            run_path("report/hidden_states.png"),
            caption="../report/hidden_states.rst",
            category="3. Hidden states",
        ),
        training=report(
            run_path("report/training.png"),
            caption="../report/training.rst",
            category="4. Training",
        ),
        acceptance=report(
            run_path("report/acceptance.png"),
            caption="../report/acceptance.rst",
            category="5. Evaluation",
        ),
        families=report(
            run_path("report/families.png"),
            caption="../report/families.rst",
            category="5. Evaluation",
        ),
        choice=report(
            run_path("report/choice.png"),
            caption="../report/choice.rst",
            category="5. Evaluation",
        ),
    log:
        get_log("build_report"),
    conda:
        "../envs/eaglenest.yaml"
    threads: 1
    params:
        # Optional: read when present (wall time per generation shard), never a reason to rerun.
        generate_benchmarks=expand(bench_path("generate/{shard}.tsv"), shard=SHARDS),
        # Optional too: how busy the endpoints were (generate's activity logs).
        generate_activity=[get_activity_log(shard) for shard in SHARDS],
        run=RUN,  # the run's name, the report's title
        # report.device: the serving device's timings the family choice counts in (a
        # bench/gpu_check.py file's figures read into it, so a new file reruns the report)
        settings=settings_json(ReportSettings),
        code_version=code_version("build_report"),
    script:
        "../scripts/build_report.py"
