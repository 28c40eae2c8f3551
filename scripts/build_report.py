# Snakemake adapter for the run report: see eaglenest.report.
from eaglenest.logs import log_to
from eaglenest.report import PLOT_NAMES, RunFiles, build_report

with log_to(snakemake.log[0]):
    build_report(
        RunFiles(
            **dict(snakemake.input.items()),
            generate_benchmarks=snakemake.params.generate_benchmarks,
        ),
        out_html=snakemake.output.html,
        plots={name: getattr(snakemake.output, name) for name in PLOT_NAMES},
        run=snakemake.config["run"],
    )
