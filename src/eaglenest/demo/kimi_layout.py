"""The DeepSeek-V3 demo target in Kimi-K2.5's layout (`demo_target.layout: kimi_k25`): the same
language model, wrapped as Kimi-K2.5 ships its own, so that the pipeline meets at demo size what
it meets on the real checkpoint.

What the wrap writes, beside the text model's tokenizer files and generation_config.json:
- config.json: `KimiK25ForConditionalGeneration`, `model_type: kimi_k25`, the DeepSeek-V3 config
  as `text_config` with `model_type: kimi_k2`, a one-layer `kimi_k25_vision` tower, and
  `media_placeholder_token_id`, which Kimi-K2.5's config.json has and transformers' Kimi_K25Config
  does not: vLLM 0.32's EAGLE proposer reads it from the target's config
  (v1/spec_decode/llm_base_proposer.py), so a drafter cannot load beside a config without it.
- the text model's tensors under `language_model.` (`language_model.model.layers...`,
  `language_model.lm_head.weight`) in one safetensors file, the vision tower and projector under
  Kimi-K2.5's own names in a second, and model.safetensors.index.json.
- preprocessor_config.json (`media_proc_cfg` as Kimi-K2.5's): vLLM 0.32 loads an image processor
  for this architecture even with `--language-model-only` (KimiK25ProcessingInfo.__init__), and
  fails to start without one.
- a Kimi-style chat template (kimi_chat_template.jinja: switches on `thinking`, ends the
  generation prompt with `<think>`) on the demo tokenizer's turn markers.

The media token ids are Kimi-K2.5's (163605 and its neighbours), outside the demo vocabulary: no
text prompt holds them, which is all a text-only run needs of them.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

LAYOUTS = ("plain", "kimi_k25")
LANGUAGE_FILE = "model-00001-of-00002.safetensors"
VISION_FILE = "model-00002-of-00002.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Written by the wrap itself (the rest of the text model's directory is copied as it is).
REWRITTEN = ("config.json", "model.safetensors", "chat_template.jinja", "tokenizer_config.json")
# Kimi-K2.5's media token ids (its config.json and tokenizer).
MEDIA_PLACEHOLDER_TOKEN_ID = 163605
# A vision tower of one layer at demo size, in transformers' Kimi_K25VisionConfig terms (which
# vLLM's MoonViT reads too).
VISION_CONFIG = {
    "model_type": "kimi_k25_vision",
    "patch_size": 14,
    "pos_emb_height": 4,
    "pos_emb_width": 4,
    "pos_emb_time": 4,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "hidden_act": "gelu_pytorch_tanh",
    "merge_kernel_size": [2, 2],
}
# Kimi-K2.5's preprocessor_config.json `media_proc_cfg` (what vLLM's KimiK25 image processor
# reads).
MEDIA_PROC_CFG = {
    "in_patch_limit": 16384,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None,
    "temporal_merge_kernel_size": 4,
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "timestamp_mode": "hh:mm:ss.fff",
    "config_type": "kimi_k25",
}


def kimi_chat_template() -> str:
    return resources.files("eaglenest.demo").joinpath("kimi_chat_template.jinja").read_text()


def kimi_config(text: dict[str, Any]) -> dict[str, Any]:
    """config.json of the wrapper around the text model whose config.json is `text`."""
    text_config = {**text, "model_type": "kimi_k2"}
    for key in ("transformers_version", "dtype", "torch_dtype"):
        text_config.pop(key, None)
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text_config,
        "vision_config": VISION_CONFIG,
        "projection_hidden_size": VISION_CONFIG["hidden_size"],
        "image_token_id": MEDIA_PLACEHOLDER_TOKEN_ID,
        "media_placeholder_token_id": MEDIA_PLACEHOLDER_TOKEN_ID,
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
        "pad_token_id": text.get("pad_token_id"),
        "dtype": text.get("dtype") or text.get("torch_dtype") or "float32",
    }


def vision_tensors(text_hidden_size: int, seed: int = 0) -> dict[str, Any]:
    """A random one-layer vision tower and its projector under Kimi-K2.5's checkpoint names (as
    vLLM's kimi_k25.py loads them): never run on text, present so the layout is whole."""
    import torch

    d, inner = VISION_CONFIG["hidden_size"], VISION_CONFIG["intermediate_size"]
    patch, grid = VISION_CONFIG["patch_size"], VISION_CONFIG["pos_emb_height"]
    merged = d * VISION_CONFIG["merge_kernel_size"][0] * VISION_CONFIG["merge_kernel_size"][1]
    block = "vision_tower.encoder.blocks.0."
    shapes = {
        "vision_tower.patch_embed.proj.weight": (d, 3, patch, patch),
        "vision_tower.patch_embed.proj.bias": (d,),
        "vision_tower.patch_embed.pos_emb.weight": (grid, VISION_CONFIG["pos_emb_width"], d),
        block + "wqkv.weight": (3 * d, d),
        block + "wqkv.bias": (3 * d,),
        block + "wo.weight": (d, d),
        block + "wo.bias": (d,),
        block + "mlp.fc0.weight": (inner, d),
        block + "mlp.fc0.bias": (inner,),
        block + "mlp.fc1.weight": (d, inner),
        block + "mlp.fc1.bias": (d,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (text_hidden_size, merged),
        "mm_projector.proj.2.bias": (text_hidden_size,),
    }
    norms = [block + "norm0", block + "norm1", "vision_tower.encoder.final_layernorm"]
    norms.append("mm_projector.pre_norm")
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: (
            torch.randn(shape, generator=generator) * 0.02 if len(shape) > 1 else torch.zeros(shape)
        )
        for name, shape in shapes.items()
    }
    for norm in norms:
        tensors[f"{norm}.weight"], tensors[f"{norm}.bias"] = torch.ones(d), torch.zeros(d)
    return tensors


def _text_model_tensors(text_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(text_dir.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{text_dir}: no model*.safetensors to wrap")
    tensors: dict[str, Any] = {}
    for path in files:
        tensors |= load_file(str(path))
    return tensors


def _tokenizer_config(text_dir: Path) -> dict[str, Any]:
    """The text model's tokenizer_config.json, without a chat template of its own (the wrap's
    is chat_template.jinja, which transformers and vLLM read first)."""
    path = text_dir / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.pop("chat_template", None)
    return config


def wrap_kimi_k25(text_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the text model saved at `text_dir` (a DeepseekV3ForCausalLM checkpoint with its
    tokenizer) in Kimi-K2.5's layout at `out_dir`; `out_dir` may be `text_dir` (wrapped in
    place). A demo-size model: its tensors are read into memory."""
    from safetensors.torch import save_file

    text_dir, out_dir = Path(text_dir), Path(out_dir)
    text = json.loads((text_dir / "config.json").read_text())
    if text.get("model_type") != "deepseek_v3":
        raise ValueError(
            f"{text_dir}/config.json: model_type {text.get('model_type')!r}; the Kimi-K2.5 layout "
            "(demo_target.layout: kimi_k25) wraps a deepseek_v3 text model "
            "(demo_target.architecture: deepseek_v3)"
        )
    language = {f"language_model.{name}": t for name, t in _text_model_tensors(text_dir).items()}
    tokenizer_config = _tokenizer_config(text_dir)
    if out_dir != text_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in text_dir.iterdir():
            if path.is_file() and path.name not in REWRITTEN:
                shutil.copy2(path, out_dir / path.name)
    for path in out_dir.glob("model*.safetensors*"):
        path.unlink()
    shards = {LANGUAGE_FILE: language, VISION_FILE: vision_tensors(text["hidden_size"])}
    weight_map: dict[str, str] = {}
    for file_name, tensors in shards.items():
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file_name)
    total = sum(t.numel() * t.element_size() for s in shards.values() for t in s.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    files = {
        INDEX_FILE: index,
        "config.json": kimi_config(text),
        "preprocessor_config.json": {"media_proc_cfg": MEDIA_PROC_CFG},
        "tokenizer_config.json": tokenizer_config,
    }
    for name, data in files.items():
        (out_dir / name).write_text(json.dumps(data, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(kimi_chat_template())
    return out_dir
