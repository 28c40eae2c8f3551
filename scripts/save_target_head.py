# Snakemake adapter: the target's embedding, LM head and final norm, once per run.
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.logs import log_to
from eaglenest.formats.target_head import save_target_head
from eaglenest.settings.hidden_states import TargetHeadSettings

with log_to(snakemake.log[0]):
    save_target_head(snakemake.output.head, TargetHeadSettings.from_json(snakemake.params.settings))
