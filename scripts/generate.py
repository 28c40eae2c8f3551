# Snakemake adapter for the generate stage: see eaglenest.generate.
from eaglenest.generate import generate_shard
from eaglenest.logs import log_to

with log_to(snakemake.log.generate):
    generate_shard(
        prompts=snakemake.input.prompts,
        probe=snakemake.input.probe,
        out=snakemake.output.raw,
        config=snakemake.config,
        journal=snakemake.params.journal,
        server_log=snakemake.log.server,
        shard=snakemake.wildcards.shard,
    )
