# Snakemake adapter for the generate stage (the shard's prompts, then their answers): see
# eaglenest.stages.prompts.write_prompt_shard and eaglenest.stages.generate.
from eaglenest.common.logs import log_to
from eaglenest.stages.generate import generate_shard
from eaglenest.stages.prompts import write_prompt_shard

with log_to(snakemake.log.generate):
    write_prompt_shard(
        snakemake.config,
        snakemake.wildcards.shard,
        snakemake.output.prompts,
        prepared=snakemake.input.prompts,
    )
    generate_shard(
        prompts=snakemake.output.prompts,
        probe=snakemake.input.probe,
        out=snakemake.output.raw,
        config=snakemake.config,
        journal=snakemake.params.journal,
        server_log=snakemake.log.get("server"),
        shard=snakemake.wildcards.shard,
    )
