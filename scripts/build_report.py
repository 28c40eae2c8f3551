# Snakemake adapter for the run report: see eaglenest.stages.report (report.py builds it).
from eaglenest.common.logs import log_to
from eaglenest.stages.report.inputs import RunFiles
from eaglenest.stages.report.report import PLOT_NAMES, build_report

with log_to(snakemake.log[0]):
    build_report(
        RunFiles(
            **dict(snakemake.input.items()),
            generate_benchmarks=snakemake.params.generate_benchmarks,
            generate_activity=snakemake.params.generate_activity,
        ),
        out_html=snakemake.output.html,
        plots={name: getattr(snakemake.output, name) for name in PLOT_NAMES},
        run=snakemake.params.run,
    )
