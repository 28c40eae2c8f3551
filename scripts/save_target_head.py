# Snakemake adapter: the target's embedding, LM head and final norm, once per run.
from eaglenest.common.logs import log_to
from eaglenest.formats.target_head import save_target_head
from eaglenest.settings.hidden import HiddenSettings
from eaglenest.settings.target import TargetModel

settings = HiddenSettings.from_json(snakemake.params.settings)
target = TargetModel.from_json(snakemake.params.target)
with log_to(snakemake.log[0]):
    save_target_head(
        target_path=target.path,
        out=snakemake.output.head,
        settings=settings,
        trust_remote_code=target.trust_remote_code,
    )
