# Snakemake adapter for one evaluation set: see eaglenest.stages.eval_sets.eval_sets.
from eaglenest.common.threads import use_threads

# First: polars sizes its thread pool when it loads.
use_threads(snakemake.threads)

from eaglenest.common.logs import log_to
from eaglenest.settings.eval_sets import EvalSetLimits, EvalSetSettings
from eaglenest.stages.eval_sets.eval_sets import prepare_eval_set

with log_to(snakemake.log[0]):
    prepare_eval_set(
        EvalSetSettings.from_json(snakemake.params.settings),
        out=snakemake.output.prompts,
        report=snakemake.output.report,
        limits=EvalSetLimits.from_json(snakemake.params.limits),
    )
