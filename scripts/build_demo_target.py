# Snakemake adapter for the demo target: see eaglenest.demo.target.
import torch

from eaglenest.common.logs import log_to
from eaglenest.demo.target import build_demo_target
from eaglenest.settings.demo_target import DemoTargetSettings

settings = DemoTargetSettings.from_json(snakemake.params.settings)
with log_to(snakemake.log[0]):
    torch.set_num_threads(max(1, snakemake.threads))
    build_demo_target(snakemake.output.target, settings)
