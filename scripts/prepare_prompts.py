# Snakemake adapter for the prompts stage (read and order the source): see eaglenest.stages.prompts.
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.logs import log_to
from eaglenest.settings.prompts import PromptOptions
from eaglenest.stages.prompts.prompts import prepare_prompts

options = PromptOptions.from_json(snakemake.params.prompts)
with log_to(snakemake.log[0]):
    prepare_prompts(options, snakemake.output.prompts, report=snakemake.output.report)
