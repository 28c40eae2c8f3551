# Snakemake adapter for the run report: see eaglenest.stages.report (report.py builds it).
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.logs import log_to
from eaglenest.settings.report import ReportSettings
from eaglenest.stages.report.inputs import RunFiles
from eaglenest.stages.report.report import PLOT_NAMES, build_report

with log_to(snakemake.log[0]):
    report = ReportSettings.from_json(snakemake.params.settings)
    build_report(
        RunFiles(
            **dict(snakemake.input.items()),
            generate_benchmarks=snakemake.params.generate_benchmarks,
            generate_activity=snakemake.params.generate_activity,
        ),
        out_html=snakemake.output.html,
        plots={name: getattr(snakemake.output, name) for name in PLOT_NAMES},
        run=snakemake.params.run,
        summary=snakemake.output.summary,
        device=report.device,
        collapse_ratio=report.collapse_ratio,
    )
