# Snakemake adapter for the generate stage (the shard's prompts, then their answers): see
# eaglenest.stages.prompts.prompts.write_prompt_shard and eaglenest.stages.generate.
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.logs import log_to
from eaglenest.settings.generate import GenerationClientSettings, RequestSettings
from eaglenest.settings.prompts import PromptOptions
from eaglenest.stages.generate.generate import generate_shard
from eaglenest.stages.prompts.prompts import write_prompt_shard

with log_to(snakemake.log.generate):
    write_prompt_shard(
        PromptOptions.from_json(snakemake.params.prompts),
        snakemake.wildcards.shard,
        snakemake.output.prompts,
        prepared=snakemake.input.prompts,
    )
    generate_shard(
        prompts=snakemake.output.prompts,
        probe=snakemake.input.probe,
        out=snakemake.output.raw,
        request=RequestSettings.from_json(snakemake.params.settings),
        client=GenerationClientSettings.from_json(snakemake.params.client),
        journal=snakemake.params.journal,
        server_log=snakemake.log.get("server"),
        shard=snakemake.wildcards.shard,
        activity=snakemake.log.activity,
    )
