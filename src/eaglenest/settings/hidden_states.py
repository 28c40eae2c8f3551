"""Settings of the hidden-state stage (the `hidden` section and the target it loads), of its
backend check, of the target head (which shares the aux layer ids) and of where training finds
the states (`hidden.store`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from eaglenest.settings import Settings
from eaglenest.settings.families import layer_rules
from eaglenest.settings.target import TargetSettings
from eaglenest.settings.vllm import VllmEngine

# What every run captured before families read other layers: vLLM's default alone (EAGLE-3's
# and P-EAGLE's), left out of the settings' JSON so that those runs recapture nothing.
VLLM_LAYERS_ONLY = MappingProxyType({"layer_rules": ("vllm",)})


def default_layer_rules(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The rules whose union a null hidden.aux_layer_ids captures (those of train.families that
    read their default layers: settings/families.py `layer_rules`); where the
    layers are set, none is read: vLLM's alone, left out of the JSON (adding a family to such a
    run recaptures nothing)."""
    if config["hidden"]["aux_layer_ids"] is not None:
        return VLLM_LAYERS_ONLY["layer_rules"]
    return layer_rules(config["train"]["families"], config["train"]["aux_layer_ids"])


@dataclass(frozen=True)
class HiddenSettings(Settings):
    LEFT_OUT_AT = VLLM_LAYERS_ONLY

    aux_layer_ids: tuple[int, ...] | None  # None: the union of layer_rules' defaults
    # settings/families.py LAYER_RULES of train.families (`captured_layer_ids`): ("vllm",) is
    # vLLM's (2, N//2, N-3); with dflash also z-lab's five. Read only where aux_layer_ids is None.
    layer_rules: tuple[str, ...]
    target_signal: str  # "final_hidden" or "topk"
    top_k: int
    dtype: str  # storage: "bf16", "fp8" or "fp32"
    model_dtype: str
    max_batch_tokens: int
    device: str  # "auto" (eaglenest.common.devices.resolve_device) or a torch device
    backend: str  # "transformers" or "vllm"
    engine: VllmEngine | None  # with the vllm backend only: a vllm section change reruns only it
    target: TargetSettings  # path and trust_remote_code to load it, model to name it

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> HiddenSettings:
        section = config["hidden"]
        own = set(cls.__dataclass_fields__) - {"engine", "target", "layer_rules"}
        values = {k: section[k] for k in own}
        values["layer_rules"] = default_layer_rules(config)
        values["engine"] = VllmEngine.from_config(config) if section["backend"] == "vllm" else None
        values["target"] = TargetSettings.view(config, "model", "path", "trust_remote_code")
        if values["aux_layer_ids"] is not None:
            values["aux_layer_ids"] = tuple(values["aux_layer_ids"])
        return cls(**values)


@dataclass(frozen=True)
class HiddenVerifySettings(Settings):
    """`hidden.verify_samples` and `hidden.verify_tolerance`: the backend check of
    stages/hidden_states/verify.py, apart from HiddenSettings so that changing it recaptures
    nothing."""

    samples: int
    tolerance: float

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> HiddenVerifySettings:
        section = config["hidden"]
        return cls(samples=section["verify_samples"], tolerance=section["verify_tolerance"])


@dataclass(frozen=True)
class TargetHeadSettings(Settings):
    """The target head's: which aux layers the head file records (hidden.aux_layer_ids) and where
    the target is; apart from HiddenSettings, so that a change of how hidden states are captured
    (batch, storage dtype, backend, device) does not read the checkpoint again."""

    LEFT_OUT_AT = VLLM_LAYERS_ONLY

    aux_layer_ids: tuple[int, ...] | None
    layer_rules: tuple[str, ...]  # as HiddenSettings'
    target: TargetSettings  # path and trust_remote_code

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TargetHeadSettings:
        layer_ids = config["hidden"]["aux_layer_ids"]
        return cls(
            aux_layer_ids=tuple(layer_ids) if layer_ids is not None else None,
            layer_rules=default_layer_rules(config),
            target=TargetSettings.view(config, "path", "trust_remote_code"),
        )


STORE_MODES = ("files", "none", "budget")


@dataclass(frozen=True)
class HiddenStoreSettings(Settings):
    """`hidden.store` and `hidden.cache_gb`: whether the states are stored as files (files), asked
    of the capture servers by training and evaluation (none), or both, split by shard (budget).
    Apart from HiddenSettings, so that changing the mode recaptures no stored shard."""

    store: str  # "files", "none" or "budget"
    cache_gb: float | None  # with budget: the stored training shards' disk, in GB

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> HiddenStoreSettings:
        section = config["hidden"]
        return cls(store=section["store"], cache_gb=section["cache_gb"])

    @property
    def from_pool(self) -> bool:
        """Whether some states come from the capture servers instead of files."""
        return self.store != "files"


def check_store(config: Mapping[str, Any]) -> None:
    """`hidden.store` none and budget need what they ask the states of: the vllm backend and at
    least one capture server; budget needs `hidden.cache_gb`, which no other store reads (it was
    silently ignored). Raises a ValueError naming the key."""
    from eaglenest.settings.vllm import capture_urls

    hidden = config.get("hidden") or {}
    store = hidden.get("store", "files")
    if store != "budget" and hidden.get("cache_gb") is not None:
        raise ValueError(
            f"hidden.cache_gb {hidden['cache_gb']} is read by hidden.store budget only, and this "
            f"run's store is {store}: set hidden.store budget, or remove hidden.cache_gb"
        )
    if store == "files":
        return
    if hidden.get("backend", "transformers") != "vllm":
        raise ValueError(
            f"hidden.store {store} asks the capture servers for the states: it needs "
            f"hidden.backend vllm (found {hidden.get('backend', 'transformers')})"
        )
    if not capture_urls(config.get("vllm") or {}):
        raise ValueError(
            f"hidden.store {store} asks the capture servers for the states: set vllm.capture_urls "
            "(or vllm.capture_url), the servers `eaglenest serve-capture` starts"
        )
    if store == "budget" and hidden.get("cache_gb") is None:
        raise ValueError("hidden.store budget needs hidden.cache_gb (the stored shards' disk, GB)")
