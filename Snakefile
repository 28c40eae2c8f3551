# eaglenest: prompts -> probe -> generate -> samples (validate + tokenize) -> hidden -> train -> report.
# `snakemake --cores all` runs the embedded demo (config/config.yaml); real targets:
# `snakemake --cores all --configfile config/examples/<target>.yaml`.
from snakemake.utils import min_version

min_version("9.0")


# The embedded demo only when the command names no config of its own: a run with --configfile gets
# its files over the schema's defaults, never a demo value it did not ask for (a variant of the
# demo names config/config.yaml first, e.g. `--configfile config/config.yaml config/tests/x.yaml`).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/demo_target.smk"
include: "rules/probe.smk"
include: "rules/prompts.smk"
include: "rules/generate.smk"
include: "rules/samples.smk"
include: "rules/vocab.smk"
include: "rules/hidden_states.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/eval_sets.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        get_final_outputs(),
        get_eval_set_outputs(),
