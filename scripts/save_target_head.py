# Snakemake adapter: the target's embedding, LM head and final norm, once per run.
from eaglenest.hidden_states import HiddenSettings, save_target_head
from eaglenest.logs import log_to

target = snakemake.config["target"]
with log_to(snakemake.log[0]):
    save_target_head(
        target_path=target["path"],
        out=snakemake.output.head,
        settings=HiddenSettings.from_config(snakemake.config["hidden"]),
        trust_remote_code=target["trust_remote_code"],
    )
