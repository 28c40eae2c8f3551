# Snakemake adapter for the prompts stage (read and order the source): see eaglenest.prompts.
from eaglenest.logs import log_to
from eaglenest.prompts import prepare_prompts

with log_to(snakemake.log[0]):
    prepare_prompts(snakemake.config, snakemake.output.prompts, report=snakemake.output.report)
