# Snakemake adapter: the target's embedding, LM head and final norm, once per run.
from eaglenest.common.logs import log_to
from eaglenest.formats.hidden_shard import HiddenSettings
from eaglenest.formats.target_head import save_target_head

target = snakemake.config["target"]
with log_to(snakemake.log[0]):
    save_target_head(
        target_path=target["path"],
        out=snakemake.output.head,
        settings=HiddenSettings.from_config(snakemake.config["hidden"]),
        trust_remote_code=target["trust_remote_code"],
    )
