"""Drafters trained elsewhere beside the run's own (`evaluate.compare`, the rule evaluate_compare:
one job per name, so adding one reruns nothing else): each decoded in vLLM on the run's held-out
prompts, depth cuts and standard sets, at the run's K, exactly as evaluate_drafter decodes the
run's drafter (vllm_evaluate.engine_metrics), into eval_compare/{name}.json.

vLLM's speculative method is read from the drafter's config.json, as vLLM would serve it:
- the speculators format (`speculators_model_type`): eagle3, peagle (EAGLE-3 with parallel
  drafting), dflash, eagle;
- the Hugging Face layouts: a DFlash drafter (`dflash_config` or a DFlash architecture), an
  EAGLE-3 one (an architecture naming Eagle3; P-EAGLE when it carries a mask token and
  `parallel_drafting`), an EAGLE one.
A DFlash drafter drafts block_size - 1 tokens whatever evaluate.ks says (settings/families.py
`block_served_k`); the others every K of evaluate.ks. A drafter vLLM's CPU build does not serve beside the target is a
reason in `engine.not_served`, as for the run's own families.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.common.devices import resolve_device
from eaglenest.common.io import write_json
from eaglenest.formats.metrics import CompareMetrics, EngineRun
from eaglenest.settings.evaluate import CompareSettings
from eaglenest.settings.families import MASK_TOKEN_KEYS, block_served_k
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.evaluate.depths import cut_at_depths
from eaglenest.stages.evaluate.live import heldout_prompts
from eaglenest.stages.evaluate.sets import EngineSets
from eaglenest.stages.evaluate.vllm_evaluate import engine_metrics

log = logging.getLogger(__name__)

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
    block_ks: tuple[int, ...] | None  # the K it drafts at whatever evaluate.ks says (DFlash)
    described: str  # what config.json said, for metrics.json

    def ks(self, configured: tuple[int, ...]) -> tuple[int, ...]:
        return self.block_ks or configured

    def speculative_config(self, drafter_dir: str | Path, k: int) -> dict[str, Any]:
        return {**self.method, "model": str(drafter_dir), "num_speculative_tokens": k}


def _dflash_ks(config: dict[str, Any], where: str) -> tuple[int, ...]:
    block = config.get("block_size") or (config.get("dflash_config") or {}).get("block_size")
    if not isinstance(block, int) or block < 2:
        raise CompareError(f"{where}: a DFlash drafter without a block_size of 2 or more")
    return (block_served_k(block),)


def compared_drafter(directory: str | Path, key: str = "evaluate.compare") -> ComparedDrafter:
    """How vLLM serves the drafter in `directory`, read from its config.json."""
    path = Path(directory) / "config.json"
    where = f"config key {key!r}: {path}"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CompareError(f"{where}: cannot read it ({err})") from None
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind not in SPECULATORS_METHODS:
            raise CompareError(
                f"{where}: speculators_model_type {kind!r} is not one of "
                f"{', '.join(SPECULATORS_METHODS)}"
            )
        method = SPECULATORS_METHODS[kind]
        block = _dflash_ks(config, where) if method["method"] in BLOCK_METHODS else None
        return ComparedDrafter(str(directory), method, block, f"speculators {kind}")
    names = " ".join(config.get("architectures") or [])
    found = [marker for marker in ARCHITECTURE_METHODS if marker in names.lower()]
    marker = "dflash" if "dflash_config" in config else next(iter(found), None)
    if marker in BLOCK_METHODS:
        block = _dflash_ks(config, where)
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


def evaluate_compare(
    *,
    name: str,
    drafter_dir: str | Path,
    heldout_tokens: list[str | Path],
    out: str | Path,
    settings: CompareSettings,
    runtime: VllmRuntime | None,
    sets: EngineSets | None = None,
) -> dict[str, Any]:
    """The compared drafter `name`'s figures: vLLM's on the held-out prompts (`engine`), its depth
    cuts (`engine.by_depth`: depth -> K -> figures) and the sets (`sets`), written to `out`."""
    started = time.perf_counter()
    drafter = compared_drafter(drafter_dir, f"evaluate.compare.{name}")
    settings = dataclasses.replace(settings, ks=drafter.ks(settings.ks))
    prompts = heldout_prompts(heldout_tokens, settings.live_prompts)
    continuation = settings.live_max_new_tokens
    cuts = cut_at_depths(heldout_tokens, settings.depths, settings.live_prompts, continuation)
    model_dtype = "float32" if resolve_device(settings.device) == "cpu" else "auto"
    log.info("compared drafter %s (%s): %s, K %s", name, drafter_dir, drafter.method, settings.ks)
    engine_args = (runtime, model_dtype, drafter.speculative_config, True, sets)
    engine = engine_metrics(drafter_dir, prompts, cuts, settings, *engine_args)
    set_figures = engine.pop("sets", {})
    metrics = CompareMetrics(
        name=name,
        drafter=str(drafter_dir),
        described=drafter.described,
        method=drafter.method,
        ks=list(settings.ks),
        engine=EngineRun.from_json(engine, "engine"),
        sets=set_figures if sets is not None else None,
        wall_s=time.perf_counter() - started,
    )
    write_json(out, metrics.to_json())
    return metrics.to_json()
