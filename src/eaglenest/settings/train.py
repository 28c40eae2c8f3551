"""Settings of the train stage: the `train` section, less which shards are held out (the rule's
inputs say that)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from eaglenest.settings import NotTracked, Settings
from eaglenest.settings.families import (
    FAMILIES,
    FAMILY_SPECS,
    DFlashSettings,
    PEagleSettings,
    family_spec,
)
from eaglenest.settings.target import TargetSettings


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
    attention: str  # llama | mla: EAGLE-3's (P-EAGLE, DFlash: llama/Qwen3 attention always)
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
class SequenceSettings(Settings):
    """`train.sequence`: which tokens of a sample a drafter trains on, at which rotary positions
    (eaglenest.drafter.views applies it). `whole`: every token from position 0; `head`: the
    first `length` tokens (the peers' recipe); `windows`: a sample longer than `length` trains
    on a sink (its first tokens) and a window at a random depth of its answer, both at their
    true positions; a sample no longer than `length` trains whole in every mode but `whole`'s
    equal."""

    SECTION = "train.sequence"
    MODES = ("whole", "head", "windows")

    mode: str
    length: int
    sink: str | int  # "prompt" (the sample's prompt, capped at length // 2) or a token count

    def __post_init__(self) -> None:
        if self.mode not in self.MODES:
            raise ValueError(f"train.sequence.mode {self.mode!r}: one of {', '.join(self.MODES)}")
        if self.sink != "prompt" and not (
            isinstance(self.sink, int) and 0 <= self.sink < self.length
        ):
            raise ValueError(
                f"train.sequence.sink {self.sink!r}: 'prompt' or a token count below "
                f"train.sequence.length ({self.length}), so that the window keeps a token"
            )

    @property
    def has_sink(self) -> bool:
        """Whether a windowed sample keeps tokens apart from its window (positions jump)."""
        return self.mode == "windows" and self.sink != 0

    def check_window(self, sliding_window: int | None) -> None:
        """A sliding window counts rotary positions by a row's index (drafter/attention.py): a
        sink before a window at depth would be seen by keys it is far from when served."""
        if sliding_window is not None and self.has_sink:
            raise ValueError(
                f"train.drafter.sliding_window {sliding_window} with train.sequence.sink "
                f"{self.sink!r} (mode windows): the window would count a sink's tokens as near; "
                "set train.sequence.sink: 0, or mode head or whole"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SequenceSettings:
        values = config["train"]["sequence"]
        return cls(**{name: values[name] for name in cls.__dataclass_fields__})


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
    sequence: SequenceSettings  # which tokens and positions of a sample training reads
    target: TargetSettings  # path and trust_remote_code: the drafter's sizes from its config

    def recorded(self) -> dict[str, Any]:
        """The `train` section's values, as train_report.json and checkpoints record them: where
        the target lies is the run's, not the training's (moving it invalidates no checkpoint)."""
        values = dataclasses.asdict(self).items()
        recorded = {k: v for k, v in values if k != "target" and not isinstance(v, NotTracked)}
        return recorded | {"drafter": self.drafter.overrides()}

    def of_family(
        self, family: str, settings: PEagleSettings | DFlashSettings | None = None
    ) -> TrainSettings:
        """The view of these settings a family's training reads: the fields its spec does not
        read (settings/families.py `not_read`), and those its own `settings` (train.<family>)
        make it ignore (`train_fields_not_read`), NotTracked (left out of its job's params, an
        error where read)."""
        own, drafter = family_spec(family).not_read
        if settings is not None:
            own = (*own, *settings.train_fields_not_read())
        left_out = {name: self.not_tracked(name) for name in own}
        view = {name: self.drafter.not_tracked(name) for name in drafter}
        return dataclasses.replace(
            self, **left_out, drafter=dataclasses.replace(self.drafter, **view)
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TrainSettings:
        own = set(cls.__dataclass_fields__) - {"target", "drafter", "sequence"}
        values = {k: config["train"][k] for k in own}
        target = TargetSettings.view(config, "path", "trust_remote_code")
        drafter = DrafterSettings.from_config(config)
        sequence = SequenceSettings.from_config(config)
        adam_betas = tuple(values["adam_betas"])
        return cls(
            **{**values, "adam_betas": adam_betas},
            drafter=drafter,
            sequence=sequence,
            target=target,
        )


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


# ---- the family a job trains (train.families; the table is settings/families.py) --------


@dataclass(frozen=True)
class FamilySettings(Settings):
    """The family one train_drafter job trains, with the keys only that family reads; the
    recipe they share (optimizer, batches, objective...) is TrainSettings."""

    # Left out of the JSON at its default: the jobs of runs made before it rerun nothing.
    LEFT_OUT_AT = MappingProxyType({"aux_layer_ids": None})

    name: str  # one of FAMILIES
    # train.aux_layer_ids.<name>: the captured layers its drafter reads; None: its default
    # (settings/families.py `family_layer_ids`)
    aux_layer_ids: tuple[int, ...] | None
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
        spec = family_spec(name)
        chosen = config["train"]["aux_layer_ids"][name]
        layers = None if chosen is None else tuple(chosen)
        if spec.settings is None:
            return dataclasses.replace(cls.eagle3(), name=name, aux_layer_ids=layers)
        # A family with settings of its own has a field of that name here (None for the others).
        own = {other: None for other in FAMILIES if FAMILY_SPECS[other].settings is not None}
        own[name] = spec.settings.from_config(config)
        target = TargetSettings.view(config, "path", "tokenizer", "trust_remote_code")
        mask = config["train"]["mask_token_id"]
        return cls(name=name, aux_layer_ids=layers, mask_token_id=mask, target=target, **own)

    def own_settings(self) -> PEagleSettings | DFlashSettings | None:
        """train.<name>: the family's own settings (None for EAGLE-3)."""
        return getattr(self, self.name) if family_spec(self.name).settings is not None else None

    @classmethod
    def eagle3(cls) -> FamilySettings:
        return cls(
            name="eagle3",
            aux_layer_ids=None,
            mask_token_id=None,
            p_eagle=None,
            dflash=None,
            target=None,
        )


def train_job_settings_json(train: str, config: Mapping[str, Any], family: str) -> str:
    """The train rule's `settings` param for one family's job, from TrainSettings' JSON
    (`train`): that alone for eagle3 (what the rule tracked before families, so a finished run
    reruns nothing), else the view the family reads (`TrainSettings.of_family`) with the
    family's own settings beside it."""
    own = FamilySettings.of(config, family)
    if family_spec(family).settings is None and own.aux_layer_ids is None:
        return train  # EAGLE-3's at its default layers: the train section whole, as always
    if family_spec(family).settings is None:  # EAGLE-3 reading layers of its own choice
        values = {"train": json.loads(train), "family": json.loads(own.to_json())}
        return json.dumps(values, sort_keys=True)
    view = TrainSettings.from_json(train).of_family(family, own.own_settings())
    view = json.loads(view.to_json())
    return json.dumps({"train": view, "family": json.loads(own.to_json())}, sort_keys=True)


def train_job_settings(text: str) -> tuple[TrainSettings, FamilySettings]:
    """The inverse of `train_job_settings_json`."""
    values = json.loads(text)
    if "family" not in values:
        return TrainSettings.from_dict(values), FamilySettings.eagle3()
    return TrainSettings.from_dict(values["train"]), FamilySettings.from_dict(values["family"])


def check_sequence(train: Mapping[str, Any]) -> None:
    """train.sequence as a validated config holds it, with the drafter's window (both keys named
    where they cannot go together)."""
    values = train.get("sequence") or {}
    if not values:
        return
    sequence = SequenceSettings(values["mode"], values["length"], values["sink"])
    sequence.check_window(drafter_window(train.get("drafter") or {}))


def check_families(train: Mapping[str, Any]) -> None:
    """What train.families cannot train as vLLM serves it, refused with the keys named: each
    family's own checks (settings/families.py). train.drafter.attention is EAGLE-3's alone: P-EAGLE
    and DFlash are llama/Qwen3 attention beside any target (families.py ATTENTION_FIELDS)."""
    families, drafter = train.get("families") or [], train.get("drafter") or {}
    for spec in FAMILY_SPECS.values():
        for check in spec.checks if spec.name in families else ():
            check(train, drafter_window(drafter))
