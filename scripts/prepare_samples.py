# Snakemake adapter for the samples stage: validate the shard's raw answers (eaglenest.stages.samples.validate),
# then tokenize the samples that passed (eaglenest.stages.samples), last the lengths the report plots
# (eaglenest.formats.lengths); one log for the job, each step's lines named by its module.
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.logs import log_to
from eaglenest.formats.lengths import write_shard_lengths
from eaglenest.settings.samples import SamplesSettings
from eaglenest.stages.samples.tokenize import tokenize_shard
from eaglenest.stages.samples.validate import validate_shard
from eaglenest.target_model.tokenizer import target_vocab_size_of

settings = SamplesSettings.from_json(snakemake.params.settings)
shard = snakemake.wildcards.shard
with log_to(snakemake.log[0]):
    validate_shard(
        raw=snakemake.input.raw,
        prompts=snakemake.input.prompts,
        probe=snakemake.input.probe,
        samples_out=snakemake.output.samples,
        report_out=snakemake.output.samples_report,
        settings=settings.validation,
        shard=shard,
        vocab_size=target_vocab_size_of(settings.tokenize.target),
    )
    tokenize_shard(
        samples=snakemake.output.samples,
        probe=snakemake.input.probe,
        tokens_out=snakemake.output.tokens,
        counts_out=snakemake.output.counts,
        report_out=snakemake.output.tokens_report,
        settings=settings.tokenize,
        shard=shard,
    )
    write_shard_lengths(snakemake.output.samples, snakemake.output.tokens, snakemake.output.lengths)
