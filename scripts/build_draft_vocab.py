# Snakemake adapter for the draft vocabulary: see eaglenest.stages.vocab.
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.logs import log_to
from eaglenest.settings.vocab import VocabSettings
from eaglenest.stages.vocab import build_draft_vocab

settings = VocabSettings.from_json(snakemake.params.settings)
with log_to(snakemake.log[0]):
    build_draft_vocab(
        snakemake.input.counts, snakemake.output.vocab, snakemake.output.summary, settings
    )
