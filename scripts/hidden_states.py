# Snakemake adapter for the hidden-states stage: see eaglenest.stages.hidden_states.extract.
import torch

from eaglenest.common.gpus import claim_gpus
from eaglenest.common.logs import log_to
from eaglenest.settings.hidden import HiddenSettings
from eaglenest.settings.target import TargetModel
from eaglenest.stages.hidden_states.extract import extract_hidden_states

settings = HiddenSettings.from_json(snakemake.params.settings)
target = TargetModel.from_json(snakemake.params.target)
with log_to(snakemake.log[0]):
    # Distinct GPUs for jobs that share a machine; held until this job's process ends.
    gpus = claim_gpus(getattr(snakemake.resources, "gpu", 0))
    torch.set_num_threads(snakemake.threads)
    extract_hidden_states(
        tokens=snakemake.input.tokens,
        target_path=target.path,
        out=snakemake.output.hidden,
        summary_out=snakemake.output.summary,
        settings=settings,
        target_name=target.model,
        trust_remote_code=target.trust_remote_code,
    )
