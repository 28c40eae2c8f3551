# Snakemake adapter for one drafter of evaluate.compare: see eaglenest.stages.evaluate.compare.
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.gpus import claim_gpus
from eaglenest.common.logs import log_to
from eaglenest.settings.eval_sets import SetDecodeSettings
from eaglenest.settings.evaluate import CompareSettings
from eaglenest.settings.thinking import ThinkingSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.evaluate.compare import evaluate_compare
from eaglenest.stages.evaluate.sets import engine_sets
from eaglenest.stages.evaluate.thinking import ThinkingEvaluation

settings = CompareSettings.from_json(snakemake.params.settings)
# evaluate.sets with evaluate.engine vllm: how the sets are rendered ("" without)
sets = SetDecodeSettings.from_json(snakemake.params.sets) if snakemake.params.sets else None
# Distinct GPUs for jobs that share a machine, held for the job's work.
with log_to(snakemake.log[0]), claim_gpus(getattr(snakemake.resources, "gpu", 0)):
    evaluate_compare(
        name=snakemake.wildcards.compare,
        drafter_dir=snakemake.params.drafter,
        heldout_tokens=list(snakemake.input.tokens),
        out=snakemake.output.metrics,
        settings=settings,
        runtime=VllmRuntime.from_json(snakemake.params.runtime),
        sets=engine_sets(snakemake.input.sets, sets, settings.live_max_new_tokens),
        # the run's plain decoding (the decode_plain job's), and how the run renders the other
        # thinking mode's prompts, which it also holds
        plain=snakemake.input.plain,
        thinking=ThinkingEvaluation(ThinkingSettings.from_json(snakemake.params.thinking), []),
    )
