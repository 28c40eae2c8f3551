# Snakemake adapter for the prompts stage (read and order the source): see eaglenest.stages.prompts.
from eaglenest.common.logs import log_to
from eaglenest.settings.prompts import PromptOptions
from eaglenest.stages.prompts.prompts import prepare_prompts

options = PromptOptions.from_json(snakemake.params.prompts)
with log_to(snakemake.log[0]):
    prepare_prompts(options, snakemake.output.prompts, report=snakemake.output.report)
