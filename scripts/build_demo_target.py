# Snakemake adapter for the demo target: see eaglenest.demo.target.
from eaglenest.common.threads import use_threads

# First: torch, polars and the tokenizers size their thread pools when they load.
use_threads(snakemake.threads)

from eaglenest.common.logs import log_to
from eaglenest.demo.target import build_demo_target
from eaglenest.settings.demo_target import DemoTargetSettings

settings = DemoTargetSettings.from_json(snakemake.params.settings)
with log_to(snakemake.log[0]):
    build_demo_target(snakemake.output.target, settings)
