# Snakemake adapter for the probe stage: see eaglenest.stages.probe.
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.logs import log_to
from eaglenest.settings.probe import ProbeClientSettings, ProbeSettings
from eaglenest.stages.probe import probe_run

with log_to(snakemake.log.probe):
    probe_run(
        settings=ProbeSettings.from_json(snakemake.params.settings),
        client=ProbeClientSettings.from_json(snakemake.params.client),
        out=snakemake.output.probe,
        server_log=snakemake.log.get("server"),
        prompt_list=snakemake.input.prompts,
    )
