# Snakemake adapter for the run's plain decoding in vLLM: see eaglenest.stages.evaluate.plain.
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.gpus import claim_gpus
from eaglenest.common.logs import log_to
from eaglenest.settings.eval_sets import SetDecodeSettings
from eaglenest.settings.evaluate import PlainSettings
from eaglenest.settings.thinking import ThinkingSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.evaluate.plain import decode_plain
from eaglenest.stages.evaluate.sets import engine_sets
from eaglenest.stages.evaluate.thinking import ThinkingEvaluation

settings = PlainSettings.from_json(snakemake.params.settings)
# evaluate.sets: how the sets are rendered ("" without)
sets = SetDecodeSettings.from_json(snakemake.params.sets) if snakemake.params.sets else None
# Distinct GPUs for jobs that share a machine, held for the job's work.
with log_to(snakemake.log[0]), claim_gpus(getattr(snakemake.resources, "gpu", 0)):
    decode_plain(
        heldout_tokens=list(snakemake.input.tokens),
        out=snakemake.output.plain,
        settings=settings,
        runtime=VllmRuntime.from_json(snakemake.params.runtime),
        sets=engine_sets(snakemake.input.sets, sets, settings.live_max_new_tokens),
        # evaluate.thinking_modes: the held-out prompts in the other thinking mode too (the
        # training tokens name the mode a drafter was trained in: the evaluate jobs read them)
        thinking=ThinkingEvaluation(ThinkingSettings.from_json(snakemake.params.thinking), []),
    )
