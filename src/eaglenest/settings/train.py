"""Settings of the train stage: the `train` section, less which shards are held out (the rule's
inputs say that)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import NotTracked, Settings
from eaglenest.settings.target import TargetSettings

# The EAGLE-3 variants (booleans of train.drafter and of the exported config.json), as vLLM's
# model_executor/models/llama_eagle3.py reads them.
DRAFTER_VARIANTS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


@dataclass(frozen=True)
class DrafterSettings(Settings):
    """`train.drafter`: the EAGLE-3 variant and the attention of the drafter, and the sizes that
    override the target's (None: not set, the size follows the target's config; an explicit null
    means the same). Read by training (stages/train/initialise.py), whose checkpoint's config.json
    export and evaluation then read as the drafter's config (eaglenest.drafter.config). A family
    that reads fewer of them tracks a view (`TrainSettings.of_family`)."""

    PARTIAL = True
    SECTION = "train.drafter"

    norm_before_fc: bool
    fc_norm: bool
    norm_before_residual: bool
    norm_output: bool
    attention: str  # llama | mla
    q_lora_rank: int | None
    kv_lora_rank: int | None
    qk_nope_head_dim: int | None
    qk_rope_head_dim: int | None
    v_head_dim: int | None
    intermediate_size: int | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    max_position_embeddings: int | None
    rope_theta: float | None
    sliding_window: int | None  # the decoder layer's window in positions (None: full attention)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DrafterSettings:
        values = config["train"]["drafter"]
        fields = {f.name: values.get(f.name) for f in dataclasses.fields(cls)}
        return cls(**{**fields, "sliding_window": drafter_window(values)})

    def overrides(self) -> dict[str, Any]:
        """What the drafter's config takes over the target's: the variant, the attention and
        every size that is set (eaglenest.drafter.config.DrafterConfig.from_target); a field
        its family's view leaves out is not set."""
        values = dataclasses.asdict(self).items()
        return {k: v for k, v in values if v is not None and not isinstance(v, NotTracked)}


@dataclass(frozen=True)
class TrainSettings(Settings):
    """The `train` section's recipe. EAGLE-3's job tracks every field; another family's job a
    view of those its training reads (`of_family`: the others NotTracked)."""

    PARTIAL = True
    SECTION = "train"

    epochs: int
    max_steps: int | None
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    adam_betas: tuple[float, float]
    loss: str  # cross_entropy | forward_kl | hard_cross_entropy (stages/train/loss.py, Objective)
    target_outside_vocab: str  # renormalise | ignore (stages/train/loss.py, Objective)
    loss_positions: str  # completion | all (stages/train/loss.py, Objective)
    lm_head_init: str  # random | target | target_frozen
    init_std: float | None  # N(0, init_std) linear weights; None: PyTorch's default
    aux_noise: float  # uniform noise added to the aux states in training
    ttt_inputs: str  # data | drafter: the tokens of TTT steps >= 1
    max_batch_tokens: int
    shuffle_pool: int  # 0: fixed length-sorted batches; N: new batches each epoch (BatchPlan)
    packing: bool  # new random batches each epoch, several samples a row (BatchPlan)
    ttt_steps: int
    step_weight: float
    checkpoint_every: int
    log_every: int
    eval_every: int  # 0: held-out loss and accuracy at the end only
    seed: int
    gpus: int  # per node; above 1 (or several nodes): one process per GPU under torchrun
    nodes: int  # above 1: a torchrun agent on each node of the allocation (distributed.py)
    device: str  # "auto" (eaglenest.common.devices.resolve_device) or a torch device
    precision: str  # auto = bf16 autocast on CUDA, float32 on CPU
    export_dtype: str
    activation_checkpointing: bool  # recompute the drafter layer in backward (long samples)
    drafter: DrafterSettings  # the drafter's EAGLE-3 variant, attention and sizes
    target: TargetSettings  # path and trust_remote_code: the drafter's sizes from its config

    def recorded(self) -> dict[str, Any]:
        """The `train` section's values, as train_report.json and checkpoints record them: where
        the target lies is the run's, not the training's (moving it invalidates no checkpoint)."""
        values = dataclasses.asdict(self).items()
        recorded = {k: v for k, v in values if k != "target" and not isinstance(v, NotTracked)}
        return recorded | {"drafter": self.drafter.overrides()}

    def of_family(self, family: str) -> TrainSettings:
        """The view of these settings a family's training reads: the fields of NOT_READ[family]
        NotTracked (left out of its job's params, an error where read)."""
        own, drafter = NOT_READ[family]
        left_out = {name: self.not_tracked(name) for name in own}
        view = {name: self.drafter.not_tracked(name) for name in drafter}
        return dataclasses.replace(
            self, **left_out, drafter=dataclasses.replace(self.drafter, **view)
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TrainSettings:
        own = set(cls.__dataclass_fields__) - {"target", "drafter"}
        values = {k: config["train"][k] for k in own}
        target = TargetSettings.view(config, "path", "trust_remote_code")
        drafter = DrafterSettings.from_config(config)
        adam_betas = tuple(values["adam_betas"])
        return cls(**{**values, "adam_betas": adam_betas, "drafter": drafter, "target": target})


# The drafter's decoder layers: one, as every EAGLE-3 drafter vLLM and SGLang load.
DRAFTER_LAYERS = 1


def drafter_window(drafter: Mapping[str, Any]) -> int | None:
    """`train.drafter.sliding_window` as the drafter's one window (None: full attention): N, or a
    list with one entry (N or null) per decoder layer. Raises ValueError naming the key for what
    the drafter cannot be trained or served with."""
    value = drafter.get("sliding_window")
    if isinstance(value, list):
        if len(value) != DRAFTER_LAYERS:
            raise ValueError(
                f"train.drafter.sliding_window: {value} has {len(value)} entries, but the drafter "
                f"has {DRAFTER_LAYERS} decoder layer (one entry per layer, or one number)"
            )
        value = value[0]
    if value is not None and drafter.get("attention", "llama") == "mla":
        # deepseek_eagle3.py builds its MLA attention without a window (vLLM 0.32), and the
        # CPU MLA backend refuses one: vLLM would serve the drafter with full attention.
        raise ValueError(
            "train.drafter.sliding_window: vLLM serves the MLA drafter (attention: mla) with "
            "full attention only; set sliding_window: null or attention: llama"
        )
    return value


# ---- drafter families (train.families) --------------------------------------------------------

# What a run can train from the same token and hidden-state shards (eaglenest.stages.train.families).
FAMILIES = ("eagle3", "p_eagle", "dflash")

# The training-time test: EAGLE-3's alone. P-EAGLE drafts train.p_eagle.depths (PEagleSettings
# resolves its default, ttt_steps) from mask tokens, never drafted ones (ttt_inputs drafter is
# refused with it: check_families).
TTT_FIELDS = ("ttt_steps", "step_weight", "ttt_inputs")
# train.drafter's MLA sizes: P-EAGLE and DFlash have llama attention only (check_families).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# family -> (TrainSettings fields, DrafterSettings fields) its training never reads, so a change
# of one reruns none of its jobs (stages/train/families.py, build_recipe). DFlash's Qwen3 layers
# take none of the EAGLE-3 variants, and its blocks are always recomputed in backward.
NOT_READ: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "eagle3": ((), ()),
    "p_eagle": (TTT_FIELDS, MLA_FIELDS),
    "dflash": ((*TTT_FIELDS, "activation_checkpointing"), (*DRAFTER_VARIANTS, *MLA_FIELDS)),
}


def family_suffix(family: str) -> str:
    """What a family's paths add to EAGLE-3's: "" for eagle3 (results/{run}/drafter/, eval/,
    logs/{run}/train_drafter.log: today's runs keep their outputs), `_<family>` for the others
    (drafter_p_eagle/, eval_p_eagle/, ...). The rules' `{family_suffix}` wildcard."""
    if family not in FAMILIES:
        raise ValueError(f"train.families: {family!r} is not one of {', '.join(FAMILIES)}")
    return "" if family == "eagle3" else f"_{family}"


def family_of_suffix(suffix: str) -> str:
    """The inverse of `family_suffix`."""
    family = suffix.removeprefix("_") or "eagle3"
    if family_suffix(family) != suffix:
        raise ValueError(f"{suffix!r} is no drafter family's suffix")
    return family


@dataclass(frozen=True)
class PEagleSettings(Settings):
    """`train.p_eagle`."""

    depths: int  # tokens drafted in one forward (train.p_eagle.depths, else train.ttt_steps)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PEagleSettings:
        train = config["train"]
        return cls(depths=train["p_eagle"]["depths"] or train["ttt_steps"])


@dataclass(frozen=True)
class DFlashSettings(Settings):
    """`train.dflash`."""

    block_size: int  # the anchor and block_size - 1 drafted tokens
    num_hidden_layers: int
    max_anchors: int  # blocks per row and step, drawn among the answer's positions
    gamma: float  # slot j's loss weight exp(-(j - 1) / gamma)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DFlashSettings:
        return cls(**config["train"]["dflash"])


@dataclass(frozen=True)
class FamilySettings(Settings):
    """The family one train_drafter job trains, with the keys only that family reads; the
    recipe they share (optimizer, batches, objective...) is TrainSettings."""

    name: str  # one of FAMILIES
    mask_token_id: int | None  # p_eagle, dflash; None: the default (stages/train/families.py)
    p_eagle: PEagleSettings | None
    dflash: DFlashSettings | None
    target: TargetSettings | None  # tokenizer and path, where a mask token is defaulted

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FamilySettings:
        """The first family of train.families (a job's own: `of`)."""
        return cls.of(config, config["train"]["families"][0])

    @classmethod
    def of(cls, config: Mapping[str, Any], name: str) -> FamilySettings:
        if name == "eagle3":
            return cls.eagle3()
        train = config["train"]
        p_eagle = dflash = None
        if name == "p_eagle":
            p_eagle = PEagleSettings.from_config(config)
        elif name == "dflash":
            dflash = DFlashSettings.from_config(config)
        else:
            raise ValueError(f"train.families: {name!r} is not one of {', '.join(FAMILIES)}")
        target = TargetSettings.view(config, "path", "tokenizer", "trust_remote_code")
        return cls(name, train["mask_token_id"], p_eagle, dflash, target)

    @classmethod
    def eagle3(cls) -> FamilySettings:
        return cls(name="eagle3", mask_token_id=None, p_eagle=None, dflash=None, target=None)


def train_job_settings_json(train: str, config: Mapping[str, Any], family: str) -> str:
    """The train rule's `settings` param for one family's job, from TrainSettings' JSON
    (`train`): that alone for eagle3 (what the rule tracked before families, so a finished run
    reruns nothing), else the view the family reads (`TrainSettings.of_family`) with the
    family's own settings beside it."""
    if family == "eagle3":
        return train
    view = json.loads(TrainSettings.from_json(train).of_family(family).to_json())
    own = json.loads(FamilySettings.of(config, family).to_json())
    return json.dumps({"train": view, "family": own}, sort_keys=True)


def train_job_settings(text: str) -> tuple[TrainSettings, FamilySettings]:
    """The inverse of `train_job_settings_json`."""
    values = json.loads(text)
    if "family" not in values:
        return TrainSettings.from_dict(values), FamilySettings.eagle3()
    return TrainSettings.from_dict(values["train"]), FamilySettings.from_dict(values["family"])


def check_families(train: Mapping[str, Any]) -> None:
    """What train.families cannot train as vLLM serves it, refused with the keys named."""
    families, drafter = train.get("families") or [], train.get("drafter") or {}
    parallel = [f for f in families if f in ("p_eagle", "dflash")]
    if parallel and drafter.get("attention", "llama") == "mla":
        raise ValueError(
            f"train.families {parallel} with train.drafter.attention mla: vLLM 0.32 drafts in "
            "parallel only with llama attention (its MLA drafter has no mask_hidden, DFlash is "
            "Qwen3 attention); set attention: llama or train only eagle3"
        )
    if "dflash" in families and drafter_window(drafter) is not None:
        raise ValueError(
            "train.families dflash with train.drafter.sliding_window: the DFlash drafter attends "
            "the whole context (vLLM's CPU build serves no mixed sliding/full DFlash); set "
            "sliding_window: null or leave dflash out"
        )
    if "p_eagle" in families and train.get("ttt_inputs") == "drafter":
        raise ValueError(
            "train.families p_eagle with train.ttt_inputs drafter: P-EAGLE's depths take the "
            "mask token, never a drafted one; set ttt_inputs: data"
        )
