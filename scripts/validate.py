# Snakemake adapter for the validate stage: see eaglenest.validate.
from eaglenest.logs import log_to
from eaglenest.validate import validate_shard

with log_to(snakemake.log[0]):
    validate_shard(
        raw=snakemake.input.raw,
        prompts=snakemake.input.prompts,
        probe=snakemake.input.probe,
        samples_out=snakemake.output.samples,
        report_out=snakemake.output.report,
        settings=snakemake.config["validation"],
        shard=snakemake.wildcards.shard,
    )
