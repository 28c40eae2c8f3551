# Snakemake adapter for the train stage: see eaglenest.stages.train.train. With train.gpus > 1 or
# train.nodes > 1 it runs the same function under torchrun, one process per GPU on each node.
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.gpus import claim_gpus
from eaglenest.common.logs import log_to
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.train import train_job_settings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.train.train import run_under_torchrun, train_drafter

# The family (train.families) whose job this is, with its own settings: eagle3's are none.
settings, family = train_job_settings(snakemake.params.settings)
arguments = {
    "train_shards": list(snakemake.input.train),
    "eval_shards": list(snakemake.input.heldout),
    "target_head": snakemake.input.head,
    "draft_vocab": snakemake.input.vocab,
    "out_dir": snakemake.output.config.rsplit("/", 1)[0],
    "journal_dir": snakemake.params.journal,
    "family": family.to_json(),  # as JSON: torchrun's processes get the arguments as a file
}
if snakemake.params.hidden:  # hidden.store none/budget: tokens shards the capture servers give
    arguments.update(
        pooled_train=list(snakemake.input.pooled),
        pooled_eval=list(snakemake.input.heldout_pooled),
        # as JSON: torchrun's processes get the arguments as a file
        hidden=HiddenSettings.from_json(snakemake.params.hidden).to_json(),
        runtime=VllmRuntime.from_json(snakemake.params.runtime).to_json(),
    )
# Distinct GPUs for jobs that share a machine, held for the job's work. Several nodes are a
# scheduler's allocation, whose GPUs it chose: nothing is claimed.
local_gpus = getattr(snakemake.resources, "gpu", 0) if settings.nodes == 1 else 0
with log_to(snakemake.log[0]), claim_gpus(local_gpus):
    if settings.gpus > 1 or settings.nodes > 1:
        run_under_torchrun(settings, arguments, snakemake.log[0])
    else:
        train_drafter(**arguments, settings=settings)
