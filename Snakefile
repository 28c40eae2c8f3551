# eaglenest: prompts -> probe -> generate -> samples (validate + tokenize) -> hidden -> train -> report.
# `snakemake --cores all` runs the embedded demo (config/config.yaml); real targets:
# `snakemake --cores all --configfile config/examples/<target>.yaml`.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/demo_target.smk"
include: "rules/probe.smk"
include: "rules/prompts.smk"
include: "rules/generate.smk"
include: "rules/samples.smk"
include: "rules/hidden_states.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        get_final_outputs(),
