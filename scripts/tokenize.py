# Snakemake adapter for the tokenize stage: see eaglenest.tokenize.
from eaglenest.logs import log_to
from eaglenest.tokenize import tokenize_shard

with log_to(snakemake.log[0]):
    tokenize_shard(
        samples=snakemake.input.samples,
        tokens_out=snakemake.output.tokens,
        counts_out=snakemake.output.counts,
        report_out=snakemake.output.report,
        config=snakemake.config,
        shard=snakemake.wildcards.shard,
    )
