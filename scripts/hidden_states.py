# Snakemake adapter for the hidden-states stage: see eaglenest.stages.hidden_states.extract.
import torch

from eaglenest.common.gpus import claim_gpus
from eaglenest.common.logs import log_to
from eaglenest.formats.hidden_shard import HiddenSettings
from eaglenest.stages.hidden_states.extract import extract_hidden_states

target = snakemake.config["target"]
with log_to(snakemake.log[0]):
    # Distinct GPUs for jobs that share a machine; held until this job's process ends.
    gpus = claim_gpus(getattr(snakemake.resources, "gpu", 0))
    torch.set_num_threads(snakemake.threads)
    extract_hidden_states(
        tokens=snakemake.input.tokens,
        target_path=target["path"],
        out=snakemake.output.hidden,
        summary_out=snakemake.output.summary,
        settings=HiddenSettings.from_config(snakemake.config["hidden"]),
        target_name=target["model"],
        trust_remote_code=target["trust_remote_code"],
    )
