# Snakemake adapter for the probe stage: see eaglenest.probe.
from eaglenest.logs import log_to
from eaglenest.probe import probe_run

with log_to(snakemake.log.probe):
    probe_run(
        config=snakemake.config,
        out=snakemake.output.probe,
        server_log=snakemake.log.get("server"),
        prompt_list=snakemake.input.prompts,
    )
