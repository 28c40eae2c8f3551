# Snakemake adapter for the evaluate stage: see eaglenest.stages.evaluate.evaluate.
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.gpus import claim_gpus
from eaglenest.common.logs import log_to
from eaglenest.settings.eval_sets import SetDecodeSettings
from eaglenest.settings.evaluate import EvaluateSettings
from eaglenest.settings.families import family_spec
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.thinking import ThinkingSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.evaluate.evaluate import evaluate_drafter
from eaglenest.stages.evaluate.sets import engine_sets
from eaglenest.stages.evaluate.thinking import ThinkingEvaluation

settings = EvaluateSettings.from_json(snakemake.params.settings)
# hidden.store none/budget: the held-out states from the capture servers ("" with files)
hidden = HiddenSettings.from_json(snakemake.params.hidden) if snakemake.params.hidden else None
# evaluate.sets with evaluate.engine vllm: how the sets are rendered ("" without)
sets = SetDecodeSettings.from_json(snakemake.params.sets) if snakemake.params.sets else None
# Distinct GPUs for jobs that share a machine, held for the job's work.
with log_to(snakemake.log[0]), claim_gpus(getattr(snakemake.resources, "gpu", 0)):
    evaluate_drafter(
        drafter_dir=snakemake.input.drafter.rsplit("/", 1)[0],
        heldout_hidden=list(snakemake.input.hidden),
        heldout_tokens=list(snakemake.input.tokens),
        target_head=snakemake.input.head,
        draft_vocab=snakemake.input.vocab,
        out=snakemake.output.metrics,
        settings=settings,
        runtime=VllmRuntime.from_json(snakemake.params.runtime),
        hidden=hidden,
        # The family of train.families this job evaluates (its paths': eval/ is eagle3's).
        family=family_spec(snakemake.params.family),
        sets=engine_sets(snakemake.input.sets, sets, settings.live_max_new_tokens),
        # evaluate.thinking_modes: the held-out prompts in the other thinking mode too
        thinking=ThinkingEvaluation(
            ThinkingSettings.from_json(snakemake.params.thinking),
            list(snakemake.input.train_tokens),
        ),
        # with evaluate.engine vllm: the run's plain decoding (the decode_plain job's)
        plain=snakemake.input.plain or None,
    )
