# Snakemake adapter for the hidden-state backend check: see
# eaglenest.stages.hidden_states.verify (verify_backends).
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.gpus import claim_gpus
from eaglenest.common.logs import log_to
from eaglenest.settings.hidden_states import HiddenSettings, HiddenVerifySettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.hidden_states.verify import verify_backends

# Distinct GPUs for jobs that share a machine, held for the job's work.
with log_to(snakemake.log[0]), claim_gpus(getattr(snakemake.resources, "gpu", 0)):
    verify_backends(
        tokens=snakemake.input.tokens,
        out=snakemake.output.verify,
        settings=HiddenSettings.from_json(snakemake.params.settings),
        verify=HiddenVerifySettings.from_json(snakemake.params.verify),
        runtime=VllmRuntime.from_json(snakemake.params.runtime),
    )
