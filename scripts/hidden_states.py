# Snakemake adapter for the hidden-states stage: see eaglenest.hidden_states.
import torch

from eaglenest.gpus import claim_gpus
from eaglenest.hidden_states import HiddenSettings, extract_hidden_states
from eaglenest.logs import log_to

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
