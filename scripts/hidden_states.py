# Snakemake adapter for the hidden-states stage: see eaglenest.stages.hidden_states (plan.py for
# what both backends share, extract.py for the transformers backend, vllm_backend.py for vLLM).
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.gpus import claim_gpus
from eaglenest.common.logs import log_to
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.hidden_states.extract import extract_hidden_states
from eaglenest.stages.hidden_states.vllm_backend import capture_hidden_states_vllm

settings = HiddenSettings.from_json(snakemake.params.settings)
files = {"tokens": snakemake.input.tokens, "out": snakemake.output.hidden}
# Distinct GPUs for jobs that share a machine, held for the job's work (vLLM's processes, started
# by this one, see the same CUDA_VISIBLE_DEVICES).
with log_to(snakemake.log[0]), claim_gpus(getattr(snakemake.resources, "gpu", 0)):
    if settings.backend == "vllm":
        runtime = VllmRuntime.from_json(snakemake.params.runtime)
        capture_hidden_states_vllm(
            **files, summary_out=snakemake.output.summary, settings=settings, runtime=runtime
        )
    else:
        extract_hidden_states(**files, summary_out=snakemake.output.summary, settings=settings)
