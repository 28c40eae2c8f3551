# Snakemake adapter for the probe stage: see eaglenest.stages.probe.
from eaglenest.common.logs import log_to
from eaglenest.stages.probe import probe_run

with log_to(snakemake.log.probe):
    probe_run(
        config=snakemake.config,
        out=snakemake.output.probe,
        server_log=snakemake.log.get("server"),
        prompt_list=snakemake.input.prompts,
    )
