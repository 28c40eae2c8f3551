"""The drafter families a run trains from one capture (`train.families`), in one table: what every
stage needs to know of a family that is not its model (that is its room in eaglenest.drafter).

A family is a `FamilySpec`: its name and paths, how the report titles it, its own settings
(`train.<name>`), the train keys it never reads, the K it is served at, how vLLM serves it and
what of a config it refuses. The stages keep a table keyed by family of what they do with each
(stages/train/families.py RECIPES, stages/evaluate/families.py LOADERS and PROPOSERS,
stages/evaluate/simulated.py UNTRAINED and PREDICTIONS, stages/report/training.py
DRAFTED_SLOTS); tests/house/test_families.py names a family one of them lacks.
docs/adding-a-family.md says how to add one.

The ground floor (settings/): imported by the rules while Snakemake plans, so only the standard
library and settings/ here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings

# The EAGLE-3 variants (booleans of train.drafter and of the exported config.json), as vLLM's
# model_executor/models/llama_eagle3.py reads them.
DRAFTER_VARIANTS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
# The training-time test: EAGLE-3's alone. P-EAGLE drafts train.p_eagle.depths (PEagleSettings
# resolves its default, ttt_steps) from mask tokens, never drafted ones (ttt_inputs drafter is
# refused with it: its checks).
TTT_FIELDS = ("ttt_steps", "step_weight", "ttt_inputs")
# train.drafter's attention (llama | mla) and MLA sizes: EAGLE-3's alone. vLLM 0.32 drafts in
# parallel with llama attention only (its MLA EAGLE-3 has no mask_hidden, DFlash is Qwen3
# attention), so P-EAGLE and DFlash are llama/Qwen3 attention beside any target, an MLA one
# included: vLLM's GPU build serves a llama drafter beside Kimi-K2.5 (lightseekorg's
# kimi-k2.5-eagle3 is LlamaForCausalLMEagle3), its CPU build does not (the block size,
# vllm_engine/cpu.py: the evaluate stage's live loop measures them there).
ATTENTION_FIELDS = (
    "attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
# Where vLLM 0.32 looks for the mask token of a parallel drafter, first found first
# (v1/spec_decode/llm_base_proposer.py:356-379).
MASK_TOKEN_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")


# ---- each family's own settings (train.<family>) ---------------------------------------------


@dataclass(frozen=True)
class PEagleSettings(Settings):
    """`train.p_eagle`."""

    depths: int  # tokens drafted in one forward (train.p_eagle.depths, else train.ttt_steps)
    num_hidden_layers: int  # decoder layers of the drafter
    train_mask_embedding: bool  # the mask token's input embedding trained (exported)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PEagleSettings:
        train = config["train"]
        own = train["p_eagle"]
        return cls(
            depths=own["depths"] or train["ttt_steps"],
            num_hidden_layers=own["num_hidden_layers"],
            train_mask_embedding=own["train_mask_embedding"],
        )

    def trained_size(self) -> int:
        """What `FamilySpec.served_ks` takes of it: the depths."""
        return self.depths

    def train_fields_not_read(self) -> tuple[str, ...]:
        """TrainSettings fields these settings make its training ignore (beyond `not_read`)."""
        return ()


# DFlash's drafter heads (train.dflash.head): the target's LM head and embedding, frozen and
# never exported, as z-lab's, SpecForge's and speculators' drafters; or a head of its own over the
# draft vocabulary, trained and exported with d2t.
DFLASH_HEADS = ("target", "draft")


def dflash_gamma(block_size: int) -> float:
    """The slot decay gamma that follows the block (train.dflash.gamma null): the line through the
    DFlash paper's two points (arXiv 2602.06036: gamma 4 at block 8, speculators' default too, and
    7 at block 16, z-lab's served block), 1 + 3·block_size/8, kept outside them. Ours, not the
    paper's, between and past those points: the last drafted slot then keeps about the same
    weight (exp(-(bs - 2)/gamma): 0.22 at 8, 0.14 at 16)."""
    return 1.0 + 3.0 * block_size / 8.0


@dataclass(frozen=True)
class DFlashSettings(Settings):
    """`train.dflash`."""

    block_size: int  # the anchor and block_size - 1 drafted tokens
    num_hidden_layers: int
    max_anchors: int  # blocks per row and step, drawn among the answer's positions
    gamma: float  # slot j's loss weight exp(-(j - 1) / gamma): train.dflash.gamma or the block's
    head: str  # DFLASH_HEADS

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DFlashSettings:
        own = dict(config["train"]["dflash"])
        if own.get("gamma") is None:
            own["gamma"] = dflash_gamma(own["block_size"])
        if own.get("head") not in DFLASH_HEADS:
            raise ValueError(
                f"train.dflash.head {own.get('head')!r}: one of {', '.join(DFLASH_HEADS)}"
            )
        return cls(**own)

    def trained_size(self) -> int:
        """What `FamilySpec.served_ks` takes of it: the block size."""
        return self.block_size

    def train_fields_not_read(self) -> tuple[str, ...]:
        """With the target's head (frozen, its rows whole) train.lm_head_init is never read: a
        change of it reruns no such DFlash job."""
        return ("lm_head_init",) if self.head == "target" else ()


# ---- the K each family is served at --------------------------------------------------------


def every_k(configured: tuple[int, ...], trained: int | None) -> tuple[int, ...]:
    """EAGLE-3: every evaluate.ks, drafted in K forwards."""
    return configured


def ks_up_to_depths(configured: tuple[int, ...], depths: int | None) -> tuple[int, ...]:
    """P-EAGLE: the evaluate.ks up to the depths it was trained for (vLLM would draft more, from
    masks it never learnt), else its trained depths."""
    return tuple(k for k in configured if k <= depths) or (depths,)


def block_served_k(block_size: int) -> int:
    """The most tokens a DFlash drafter of `block_size` drafts a round: block_size - 1 (the
    bonus token takes the block's first slot)."""
    return block_size - 1


def block_ks(configured: tuple[int, ...], block_size: int | None) -> tuple[int, ...]:
    """DFlash: the evaluate.ks up to block_size - 1, else block_size - 1. vLLM 0.32 serves any
    num_speculative_tokens K with a DFlash drafter, querying the block [bonus, mask x K] (no
    check against the drafter's block_size: config/speculative.py, v1/spec_decode/dflash.py);
    past block_size - 1 the slots were never trained."""
    top = block_served_k(block_size)
    return tuple(k for k in configured if k <= top) or (top,)


# ---- the target layers each family reads by default (hidden.aux_layer_ids null) -----------


def default_aux_layer_ids(num_hidden_layers: int) -> tuple[int, ...]:
    """vLLM's default `eagle_aux_hidden_state_layer_ids` (2, N//2, N-3): EAGLE-3's and
    P-EAGLE's (the input of those decoder layers)."""
    n = num_hidden_layers
    return (2, n // 2, n - 3)


# z-lab's released DFlash drafters read five target layers (Qwen3-8B's 36: 1, 9, 17, 25, 33).
DFLASH_TARGET_LAYERS = 5


def z_lab_layers(num_hidden_layers: int) -> tuple[int, ...]:
    """DFlash's default: z-lab's `build_target_layer_ids(N, 5)` (dflash/model.py), five layers
    spread evenly from layer 1 to N-3, rounded, in the project's convention. z-lab's ids are
    "output of layer i" (hidden_states[i + 1]), the project's "input of decoder layer i", so
    each is i + 1 here (drafter/dflash/model.py `dflash_target_layer_ids` subtracts it again).
    Distinct and sorted: below 8 layers the spread repeats a layer."""
    start, end = 1, num_hidden_layers - 3
    span = end - start
    steps = DFLASH_TARGET_LAYERS - 1
    return tuple(sorted({round(start + i * span / steps) + 1 for i in range(steps + 1)}))


# A family's `layer_rule` -> its default layers of an N-layer target.
LAYER_RULES: dict[str, Callable[[int], tuple[int, ...]]] = {
    "vllm": default_aux_layer_ids,
    "z-lab": z_lab_layers,
}


# ---- what a family refuses of the train section (settings.train.check_families) ----------------


def _no_window(train: Mapping[str, Any], window: int | None) -> None:
    if window is not None:
        raise ValueError(
            "train.families dflash with train.drafter.sliding_window: the DFlash drafter attends "
            "the whole context (vLLM's CPU build serves no mixed sliding/full DFlash); set "
            "sliding_window: null or leave dflash out"
        )


def _data_ttt_inputs(train: Mapping[str, Any], window: int | None) -> None:
    if train.get("ttt_inputs") == "drafter":
        raise ValueError(
            "train.families p_eagle with train.ttt_inputs drafter: P-EAGLE's depths take the "
            "mask token, never a drafted one; set ttt_inputs: data"
        )


# ---- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FamilySpec:
    """One drafter family, as every stage sees it."""

    name: str  # train.families' name
    suffix: str  # what its paths add to EAGLE-3's: drafter{suffix}/, eval{suffix}/
    title: str  # as the report names it
    settings: type[PEagleSettings | DFlashSettings] | None  # train.<name>; None: none
    # (TrainSettings fields, DrafterSettings fields) its training never reads, so a change of one
    # reruns none of its jobs (TrainSettings.of_family)
    not_read: tuple[tuple[str, ...], tuple[str, ...]]
    # (evaluate.ks, its trained size: settings' `trained_size`) -> the K it is measured at
    served_ks: Callable[[tuple[int, ...], int | None], tuple[int, ...]]
    vllm_method: str  # speculative_config's `method`
    parallel: bool  # drafts its K tokens in one forward (from mask tokens)
    # of the train section and its drafter's window (settings.train.drafter_window)
    checks: tuple[Callable[[Mapping[str, Any], int | None], None], ...]
    # LAYER_RULES' name of the target layers it reads by default (train.aux_layer_ids null)
    layer_rule: str = "vllm"


FAMILY_SPECS: dict[str, FamilySpec] = {
    spec.name: spec
    for spec in (
        FamilySpec(
            name="eagle3",
            # "": today's runs keep their outputs (results/{run}/drafter/, eval/, ...)
            suffix="",
            title="EAGLE-3",
            settings=None,
            not_read=((), ()),
            served_ks=every_k,
            vllm_method="eagle3",
            parallel=False,
            checks=(),
        ),
        FamilySpec(
            name="p_eagle",
            suffix="_p_eagle",
            title="P-EAGLE",
            settings=PEagleSettings,
            not_read=(TTT_FIELDS, ATTENTION_FIELDS),
            served_ks=ks_up_to_depths,
            vllm_method="eagle3",  # with parallel_drafting
            parallel=True,
            checks=(_data_ttt_inputs,),
        ),
        FamilySpec(
            name="dflash",
            suffix="_dflash",
            title="DFlash",
            settings=DFlashSettings,
            # DFlash's Qwen3 layers take none of the EAGLE-3 variants nor its attention, and its
            # blocks are always recomputed in backward.
            not_read=(
                (*TTT_FIELDS, "activation_checkpointing"),
                (*DRAFTER_VARIANTS, *ATTENTION_FIELDS),
            ),
            served_ks=block_ks,
            vllm_method="dflash",
            parallel=True,
            checks=(_no_window,),
            layer_rule="z-lab",
        ),
    )
}
# What a run can train from the same token and hidden-state shards, in the order the report
# and every listing shows them.
FAMILIES = tuple(FAMILY_SPECS)


def family_spec(family: str | FamilySpec) -> FamilySpec:
    """The spec of `family` (its name, or the spec itself), or ValueError naming train.families."""
    if isinstance(family, FamilySpec):
        return family
    if family not in FAMILY_SPECS:
        raise ValueError(f"train.families: {family!r} is not one of {', '.join(FAMILIES)}")
    return FAMILY_SPECS[family]


def family_suffix(family: str) -> str:
    """What a family's paths add to EAGLE-3's: "" for eagle3 (results/{run}/drafter/, eval/,
    logs/{run}/train_drafter.log: today's runs keep their outputs), `_<family>` for the others
    (drafter_p_eagle/, eval_p_eagle/, ...). The rules' `{family_suffix}` wildcard."""
    return family_spec(family).suffix


def family_of_suffix(suffix: str) -> str:
    """The inverse of `family_suffix`."""
    for spec in FAMILY_SPECS.values():
        if spec.suffix == suffix:
            return spec.name
    raise ValueError(f"{suffix!r} is no drafter family's suffix")


def layer_rules(
    families: Sequence[str], chosen: Mapping[str, Any] | None = None
) -> tuple[str, ...]:
    """The distinct default-layer rules of the families that read their default layers (no
    train.aux_layer_ids.<family> in `chosen`), in LAYER_RULES' order: what the capture of a null
    hidden.aux_layer_ids takes the union of (`captured_layer_ids`). A family that chose its
    layers reads them among those (adding it recaptures nothing); where every family chose,
    vLLM's default, as before families chose."""
    chosen = chosen or {}
    wanted = {family_spec(f).layer_rule for f in families if chosen.get(f) is None}
    return tuple(rule for rule in LAYER_RULES if rule in wanted) or ("vllm",)


def captured_layer_ids(
    chosen: Sequence[int] | None, rules: Sequence[str], num_hidden_layers: int
) -> tuple[int, ...]:
    """The layers the capture keeps: hidden.aux_layer_ids where set, else the union of the
    rules' defaults, sorted. vLLM's default alone stays as vLLM gives it (unsorted, repeats
    kept below 7 layers: what every run captured before other families' layers)."""
    if chosen is not None:
        return tuple(chosen)
    if tuple(rules) == ("vllm",):
        return default_aux_layer_ids(num_hidden_layers)
    return tuple(sorted(set().union(*(LAYER_RULES[r](num_hidden_layers) for r in rules))))


def family_layer_ids(
    family: str, chosen: Sequence[int] | None, captured: Sequence[int], num_hidden_layers: int
) -> tuple[int, ...]:
    """The captured layers a family's drafter reads, in the captured order (its columns of the
    shards' `aux`): train.aux_layer_ids.<family> where set, else the family's default layers
    where the capture holds them all (a null hidden.aux_layer_ids always does), else every
    captured layer (a hidden.aux_layer_ids set for another choice, or a default that repeats a
    layer: a target too shallow for it). ValueError naming both keys for a layer the capture
    does not hold."""
    default = LAYER_RULES[family_spec(family).layer_rule](num_hidden_layers)
    # Below 7 layers vLLM's default repeats a layer: a capture set to three distinct layers was
    # read as one or two (a 5-layer target's EAGLE-3 read layer 2 alone of [2, 3, 4]), silently.
    shallow = len(set(default)) < len(default)
    if chosen is None:
        chosen = default if set(default) <= set(captured) and not shallow else captured
    check_captured(family, chosen, captured)
    return tuple(i for i in captured if i in set(chosen))


def check_captured(family: str, chosen: Sequence[int], captured: Sequence[int]) -> None:
    """ValueError naming train.aux_layer_ids.<family> and hidden.aux_layer_ids for a layer of
    the family's the capture does not hold."""
    missing = [i for i in chosen if i not in captured]
    if missing:
        raise ValueError(
            f"train.aux_layer_ids.{family} {list(chosen)}: layers {missing} are not captured; "
            f"hidden.aux_layer_ids captures {list(captured)} (add them there, or leave it null "
            "for the union of train.families' defaults)"
        )
