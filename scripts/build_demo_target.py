# Snakemake adapter for the demo target: see eaglenest.demo.target.
import torch

from eaglenest.common.logs import log_to
from eaglenest.demo.target import build_demo_target

with log_to(snakemake.log[0]):
    torch.set_num_threads(max(1, snakemake.threads))
    settings = {k: v for k, v in snakemake.config["demo_target"].items() if k != "enabled"}
    build_demo_target(snakemake.output.target, **settings)
