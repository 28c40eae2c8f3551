"""How vLLM serves a drafter trained elsewhere (`evaluate.compare`), read from its config.json,
and the checks of each compared directory that the config check runs before any job (a dry run
shows them): config.json an object whose fields have their types, a weight file beside it, a
DFlash block bounded. The evaluate stage (stages/evaluate/compare.py) decodes what this reads.

vLLM's speculative method, as vLLM would serve the drafter:
- the speculators format (`speculators_model_type`): eagle3, peagle (EAGLE-3 with parallel
  drafting), dflash, eagle;
- the Hugging Face layouts: a DFlash drafter (`dflash_config` or a DFlash architecture), an
  EAGLE-3 one (an architecture naming Eagle3; P-EAGLE when it carries a mask token and
  `parallel_drafting`), an EAGLE one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.settings.families import MASK_TOKEN_KEYS, block_ks

# The largest DFlash block a compared drafter may have: z-lab serves 16, speculators trains 8.
MAX_BLOCK_SIZE = 64
# What a drafter directory holds its weights in, as vLLM loads them.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")

# speculators_model_type -> the method vLLM serves it with (and its extra keys)
SPECULATORS_METHODS: dict[str, dict[str, Any]] = {
    "eagle3": {"method": "eagle3"},
    "peagle": {"method": "eagle3", "parallel_drafting": True},
    "dflash": {"method": "dflash"},
    "eagle": {"method": "eagle"},
}
# What a Hugging Face layout's architectures name (first found first) -> the method vLLM serves
# it with; a config with `dflash_config` is a DFlash drafter whatever they name
ARCHITECTURE_METHODS: dict[str, dict[str, Any]] = {
    "dflash": {"method": "dflash"},
    "eagle3": {"method": "eagle3"},
    "eagle": {"method": "eagle"},
}
# vLLM methods whose drafter drafts one block, at K = block_size - 1 only
BLOCK_METHODS = {"dflash"}
# vLLM methods that draft in parallel (P-EAGLE) where the config carries a mask token and
# parallel_drafting
PARALLEL_METHODS = {"eagle3"}


class CompareError(ValueError):
    """A compared drafter vLLM would not serve as given; the message names the key and file."""


@dataclass(frozen=True)
class ComparedDrafter:
    """A drafter directory and how vLLM serves it."""

    directory: str
    method: dict[str, Any]  # vLLM's speculative_config less model and num_speculative_tokens
    block_size: int | None  # a DFlash drafter's: it drafts K up to block_size - 1
    described: str  # what config.json said, for metrics.json

    def ks(self, configured: tuple[int, ...]) -> tuple[int, ...]:
        """The K it is decoded at: a DFlash drafter's as the run's own (`block_ks`: the
        configured K up to block_size - 1, else that), so the two compare at one K."""
        return configured if self.block_size is None else block_ks(configured, self.block_size)

    def speculative_config(self, drafter_dir: str | Path, k: int) -> dict[str, Any]:
        return {**self.method, "model": str(drafter_dir), "num_speculative_tokens": k}


def _dflash_block(config: dict[str, Any], where: str) -> int:
    block = config.get("block_size") or (config.get("dflash_config") or {}).get("block_size")
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise CompareError(f"{where}: a DFlash drafter without a block_size of 2 or more")
    if block > MAX_BLOCK_SIZE:
        # vLLM would be asked for block_size - 1 speculative tokens (10^9 was)
        raise CompareError(
            f"{where}: block_size {block:,} is past {MAX_BLOCK_SIZE}, the most a drafter "
            "compared here may draft in one block"
        )
    return block


def _checked_fields(config: Any, where: str) -> dict[str, Any]:
    """config.json as a JSON object whose fields read below have their types: a list, null, an
    architectures of numbers or a mapping, a dflash_config string gave bare TypeErrors, and
    `architectures: {"Eagle3": 1}` was read as EAGLE-3 (its key)."""
    if not isinstance(config, dict):
        raise CompareError(f"{where}: holds a JSON {type(config).__name__}, not an object")
    types = {
        "architectures": (list, "a list of class names"),
        "speculators_model_type": (str, "a string"),
        "dflash_config": (dict, "an object"),
    }
    for field, (kind, said) in types.items():
        value = config.get(field)
        if value is not None and not isinstance(value, kind):
            raise CompareError(f"{where}: field {field!r} is {value!r}, not {said}")
    names = config.get("architectures") or []
    if not all(isinstance(name, str) for name in names):
        raise CompareError(
            f"{where}: field 'architectures' is {names!r}, not a list of class names"
        )
    return config


def compared_drafter(directory: str | Path, key: str = "evaluate.compare") -> ComparedDrafter:
    """How vLLM serves the drafter in `directory`, read from its config.json."""
    path = Path(directory) / "config.json"
    where = f"config key {key!r}: {path}"
    try:
        config = _checked_fields(json.loads(path.read_text()), where)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CompareError(f"{where}: cannot read it ({err})") from None
    except RecursionError:
        raise CompareError(f"{where}: nested too deeply to be a drafter's config") from None
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind not in SPECULATORS_METHODS:
            raise CompareError(
                f"{where}: speculators_model_type {kind!r} is not one of "
                f"{', '.join(SPECULATORS_METHODS)}"
            )
        method = SPECULATORS_METHODS[kind]
        block = _dflash_block(config, where) if method["method"] in BLOCK_METHODS else None
        return ComparedDrafter(str(directory), method, block, f"speculators {kind}")
    names = " ".join(config.get("architectures") or [])
    found = [marker for marker in ARCHITECTURE_METHODS if marker in names.lower()]
    marker = "dflash" if "dflash_config" in config else next(iter(found), None)
    if marker in BLOCK_METHODS:
        block = _dflash_block(config, where)
        return ComparedDrafter(str(directory), ARCHITECTURE_METHODS[marker], block, names)
    if marker is not None:
        parallel = config.get("parallel_drafting") and any(k in config for k in MASK_TOKEN_KEYS)
        extra = {"parallel_drafting": True} if parallel and marker in PARALLEL_METHODS else {}
        return ComparedDrafter(
            str(directory), {**ARCHITECTURE_METHODS[marker], **extra}, None, names
        )
    raise CompareError(
        f"{where}: cannot tell vLLM's speculative method from it (architectures {names or 'none'}, "
        "no speculators_model_type): expected the speculators format, an EAGLE-3, P-EAGLE, "
        "EAGLE or DFlash drafter"
    )


def check_compared_directory(name: str, directory: str, workdir: str | Path = ".") -> None:
    """One entry of evaluate.compare, checked before any job: a directory (not a link to
    nothing: a loop's resolve() raised), its config.json read as vLLM would serve it, and a
    weight file beside it. Raises CompareError naming the key and the file."""
    key = f"config key 'evaluate.compare.{name}'"
    path = Path(workdir) / directory
    if path.is_symlink() and not path.exists():
        raise CompareError(
            f"{key}: {directory} is a symbolic link to nothing readable (a loop, or its target "
            f"is gone: {os.readlink(path)})"
        )
    config_json = path / "config.json"
    if not config_json.is_file():
        raise CompareError(
            f"{key}: {directory} has no config.json (from the working directory: "
            f"{os.path.abspath(config_json)}); give the directory of a drafter vLLM serves "
            "(speculators format, Hugging Face EAGLE-3 or DFlash layout)"
        )
    compared_drafter(path, f"evaluate.compare.{name}")
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in path.iterdir() if p.is_file()):
        raise CompareError(
            f"{key}: {directory} holds no weights ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) "
            "beside its config.json"
        )
