# Snakemake adapter for the prompts stage (one shard's slice): see eaglenest.prompts.
from eaglenest.logs import log_to
from eaglenest.prompts import write_prompt_shard

with log_to(snakemake.log[0]):
    write_prompt_shard(
        snakemake.config,
        snakemake.wildcards.shard,
        snakemake.output.shard,
        report=snakemake.output.report,
        prepared=snakemake.input.prompts,
    )
