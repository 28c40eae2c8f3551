"""The target model itself: loading it (transformers, on the chosen device) and the facts of its
architecture that the stages share (its text config, decoder layers, vLLM's default aux layer ids).

A multimodal target nests its language model's config: Kimi-K2.5's config.json is
`KimiK25ForConditionalGeneration` with `num_hidden_layers` (61), `hidden_size` (7168) and
`vocab_size` (163,840) only under `text_config`. Every stage reads those through `text_config`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eaglenest.common.devices import resolve_device
from eaglenest.common.io import sha256_file
from eaglenest.settings.families import (
    captured_layer_ids,
    default_aux_layer_ids,  # noqa: F401 (the stages import it here)
)
from eaglenest.target_model.files import resolve_target_dir
from eaglenest.target_model.remote_code import remote_code_errors

if TYPE_CHECKING:
    from eaglenest.settings.hidden_states import HiddenSettings

log = logging.getLogger(__name__)

_MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checked_aux_layer_ids(model_config: Any, settings: HiddenSettings) -> tuple[int, ...]:
    """The decoder layers whose input is kept: the settings' or the union of train.families'
    defaults (settings/families.py `captured_layer_ids`), checked against the target's config
    (and top_k against its vocabulary). At least 3 (EAGLE-3's default reads 3), each in
    [0, N); no bound above N: vLLM's extraction keeps any number (one KV head a layer)."""
    n_layers = model_config.num_hidden_layers
    layer_ids = captured_layer_ids(settings.aux_layer_ids, settings.layer_rules, n_layers)
    if len(layer_ids) < 3 or not all(0 <= k < n_layers for k in layer_ids):
        raise ValueError(
            f"hidden.aux_layer_ids {list(layer_ids)}: need 3 or more ids in [0, {n_layers})"
        )
    if settings.target_signal == "topk" and settings.top_k > model_config.vocab_size:
        raise ValueError(f"hidden.top_k {settings.top_k} > vocabulary {model_config.vocab_size}")
    return tuple(layer_ids)


def text_config(config: Any) -> Any:
    """The language model's config: `text_config` of a multimodal one (transformers'
    get_text_config), the config itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load_text_config(target_path: str | Path, trust_remote_code: bool = False) -> Any:
    """The target's language-model config from its config.json (no weights are read)."""
    from transformers import AutoConfig

    target_dir = resolve_target_dir(target_path)
    with remote_code_errors("config", str(target_path), target_dir):
        config = AutoConfig.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)
    return text_config(config)


def target_config_hash(target_path: str | Path) -> str:
    return sha256_file(resolve_target_dir(target_path) / "config.json")


def resolve_model_dtype(model_dtype: str, device: str) -> torch.dtype:
    if model_dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return _MODEL_DTYPES[model_dtype]


def text_model_key_mapping(target_dir: Path) -> dict[str, str]:
    """Checkpoint names of a wrapped language model -> the text model's own names: from where
    the checkpoint keeps the embedding and the LM head (Kimi-K2.5: `language_model.model.` and
    `language_model.lm_head`; transformers' multimodal models: `model.language_model.` and
    `lm_head`). {} when the names are the text model's already."""
    import re

    from eaglenest.target_model.checkpoint import checkpoint_weight_map, find_head_tensors

    names = find_head_tensors(*checkpoint_weight_map(target_dir))
    mapping = {}
    embedding, head = names["embed_tokens.weight"], names["lm_head.weight"]
    if embedding is not None and embedding != "model.embed_tokens.weight":
        prefix = embedding.removesuffix("embed_tokens.weight")
        mapping[f"^{re.escape(prefix)}"] = "model."
    if head is not None and head != "lm_head.weight":
        mapping[f"^{re.escape(head)}$"] = "lm_head.weight"
    return mapping


def load_target(
    path: str | Path,
    device: str = "auto",
    model_dtype: str = "auto",
    trust_remote_code: bool = False,
):
    """The target's language model in eval mode, on `device` (device_map=auto over several GPUs).

    A multimodal wrapper (Kimi-K2.5's `KimiK25ForConditionalGeneration`: `text_config` and the
    text model's tensors under `language_model.`) has no class under AutoModelForCausalLM; its
    text model is loaded alone, as the causal LM its `text_config` names, from the wrapper's
    tensors renamed (`text_model_key_mapping`); the vision tower's are not read into it. Its
    logits and hidden states are the wrapper's on text (what every stage feeds it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = resolve_device(device)
    dtype = resolve_model_dtype(model_dtype, device)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    several_gpus = device == "cuda" and torch.cuda.device_count() > 1
    if several_gpus:
        kwargs["device_map"] = "auto"
    target_dir = resolve_target_dir(path)
    with remote_code_errors("config", str(path), target_dir):
        config = AutoConfig.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)
    text = text_config(config)
    if text is not config:
        kwargs |= {"config": text, "key_mapping": text_model_key_mapping(target_dir)}
        log.info("%s: %s's text model, %s", path, type(config).__name__, type(text).__name__)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), **kwargs)
    if not several_gpus:
        model.to(device)
    model.eval()
    return model


def decoder_layers(model) -> Any:
    return model.model.layers
