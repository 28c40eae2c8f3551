"""The target's head tensors (input embedding, final norm, LM head) read by name from its
checkpoint's safetensors files, without building the model: a 1T-parameter target's head is a few
GB of a checkpoint of hundreds. The target-head file (formats/target_head.py) and the vLLM backend
of the hidden states (the final norm it applies) read them here."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)


class TargetHeadError(RuntimeError):
    """The target's checkpoint does not hold the head as expected; the message names the file."""


# The head's tensors in the checkpoint, by name with any prefix (multimodal wrappers such as
# Kimi-K2.5 put the language model under `language_model.`; transformers' own ones use
# `model.language_model.`), and how an error describes them.
HEAD_TENSORS = {
    "embed_tokens.weight": (
        re.compile(r"^(?:.+\.)?(?:model|language_model)\.embed_tokens\.weight$"),
        "model.embed_tokens.weight or language_model.embed_tokens.weight",
    ),
    "norm.weight": (
        re.compile(r"^(?:.+\.)?(?:model|language_model)\.norm\.weight$"),
        "model.norm.weight or language_model.norm.weight",
    ),
    "lm_head.weight": (re.compile(r"^(?:.+\.)?lm_head\.weight$"), "lm_head.weight"),
}


# Towers of multimodal targets, whose tensors may end like the language model's.
_TOWER_TENSOR = re.compile(
    r"(?:^|\.)(?:vision|visual|audio|speech|mm_projector|multi_modal_projector)[^.]*\."
)


def checkpoint_weight_map(target_dir: Path) -> tuple[dict[str, str], Path]:
    """(tensor name -> safetensors file, the file that says so): the index of a sharded
    checkpoint, else the single `model.safetensors`."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"], index
    single = target_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single.name), single
    raise TargetHeadError(
        f"{target_dir}: neither model.safetensors.index.json nor model.safetensors; the target "
        "head is read from the checkpoint's safetensors files"
    )


def find_head_tensors(weight_map: dict[str, str], listing: Path) -> dict[str, str | None]:
    """Checkpoint name of each head tensor (None when absent); several candidates are an error."""
    found: dict[str, str | None] = {}
    for name, (pattern, _) in HEAD_TENSORS.items():
        matches = sorted(k for k in weight_map if pattern.match(k) and not _TOWER_TENSOR.search(k))
        if len(matches) > 1:
            raise TargetHeadError(
                f"{listing}: several tensors could be the target's {name}: {matches}"
            )
        found[name] = matches[0] if matches else None
    return found


def read_checkpoint_tensors(
    target_dir: Path, weight_map: dict[str, str], listing: Path, names: dict[str, str]
) -> dict[str, torch.Tensor]:
    """{our name: tensor} read by checkpoint name, opening each safetensors file once."""
    from safetensors import safe_open

    by_file: dict[str, dict[str, str]] = {}
    for ours, key in names.items():
        by_file.setdefault(weight_map[key], {})[ours] = key
    tensors = {}
    for file_name, wanted in by_file.items():
        path = target_dir / file_name
        if not path.is_file():
            raise TargetHeadError(
                f"{listing} puts {sorted(wanted.values())} in {path}: no such file"
            )
        with safe_open(str(path), framework="pt") as f:
            for ours, key in wanted.items():
                tensor = f.get_tensor(key)
                if not tensor.is_floating_point() or tensor.element_size() < 2:
                    raise TargetHeadError(
                        f"{path}: {key} is {tensor.dtype}; the target head needs unquantized "
                        "weights (bf16, fp16 or fp32)"
                    )
                tensors[ours] = tensor.contiguous()
    return tensors


def checkpoint_head_tensors(
    target_dir: str | Path, tied_config: bool
) -> tuple[dict[str, torch.Tensor], bool]:
    """(embedding, final norm and LM head unless tied, whether tied), read by name from the
    target's safetensors files: only these tensors are read, the model is never built.

    Tying follows transformers: with `tie_word_embeddings` the LM head is the embedding, unless
    the checkpoint holds both with different values (then they stay apart, as transformers
    leaves them); without it the checkpoint must hold the LM head."""
    target_dir = Path(target_dir)
    weight_map, listing = checkpoint_weight_map(target_dir)
    names = find_head_tensors(weight_map, listing)
    if tied_config and names["embed_tokens.weight"] is None:
        names["embed_tokens.weight"] = names["lm_head.weight"]  # transformers ties either way
    wanted = ["embed_tokens.weight", "norm.weight"] + ([] if tied_config else ["lm_head.weight"])
    missing = [name for name in wanted if names[name] is None]
    if missing:
        looked_for = "; ".join(f"{name}: {HEAD_TENSORS[name][1]}" for name in missing)
        tie = "" if tied_config else " (config.json: tie_word_embeddings is false)"
        raise TargetHeadError(
            f"{listing}: no tensor for the target's {', '.join(missing)}{tie}; looked for "
            f"{looked_for} (with any prefix, e.g. language_model.)"
        )
    present = {name: key for name, key in names.items() if key is not None}
    tensors = read_checkpoint_tensors(target_dir, weight_map, listing, present)
    head = tensors.get("lm_head.weight")
    tied = tied_config and (head is None or torch.equal(head, tensors["embed_tokens.weight"]))
    if tied_config and not tied:
        log.warning(
            "%s: config.json ties the LM head to the embedding, but the checkpoint holds both "
            "with different values; as transformers does, they stay apart",
            listing,
        )
    if tied:
        tensors.pop("lm_head.weight", None)
    log.info("target head from %s: %s", listing, {n: present[n] for n in sorted(tensors)})
    return tensors, tied
