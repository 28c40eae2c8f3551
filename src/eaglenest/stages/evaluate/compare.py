"""Drafters trained elsewhere beside the run's own (`evaluate.compare`, the rule evaluate_compare:
one job per name, so adding one reruns nothing else): each decoded in vLLM on the run's held-out
prompts, depth cuts and standard sets, at the run's K, exactly as evaluate_drafter decodes the
run's drafter (vllm_evaluate.engine_metrics), into eval_compare/{name}.json.

vLLM's speculative method is read from the drafter's config.json as vLLM would serve it
(settings/compared_drafters.py, which the config check runs on each directory before any job).
A DFlash drafter drafts the evaluate.ks up to its block_size - 1 (else that: settings/families.py
`block_ks`, as the run's own DFlash); the others every K of evaluate.ks. A drafter vLLM's CPU build does not serve beside the target is a
reason in `engine.not_served`, as for the run's own families. The plain decoding every K is
compared with is the run's one (the decode_plain job's file, plain.py), as the run's own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from eaglenest.common.io import write_json
from eaglenest.formats.metrics import CompareMetrics, EngineRun
from eaglenest.settings.compared_drafters import compared_drafter
from eaglenest.settings.evaluate import CompareSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.evaluate.plain import engine_inputs, read_plain
from eaglenest.stages.evaluate.sets import EngineSets
from eaglenest.stages.evaluate.thinking import ThinkingEvaluation
from eaglenest.stages.evaluate.vllm_evaluate import engine_metrics

log = logging.getLogger(__name__)


def evaluate_compare(
    *,
    name: str,
    drafter_dir: str | Path,
    heldout_tokens: list[str | Path],
    out: str | Path,
    settings: CompareSettings,
    runtime: VllmRuntime | None,
    sets: EngineSets | None = None,
    plain: str | Path | None = None,
    thinking: ThinkingEvaluation | None = None,
) -> dict[str, Any]:
    """The compared drafter `name`'s figures: vLLM's on the held-out prompts (`engine`), its depth
    cuts (`engine.by_depth`: depth -> K -> figures) and the sets (`sets`), written to `out`.
    `plain`: the run's plain decoding (plain.py's file; decoded here when None), which also
    holds the other thinking mode's prompts (`thinking`: how the run renders them), not
    decoded here."""
    started = time.perf_counter()
    drafter = compared_drafter(drafter_dir, f"evaluate.compare.{name}")
    settings = dataclasses.replace(settings, ks=drafter.ks(settings.ks))
    inputs = engine_inputs(heldout_tokens, settings, thinking)
    plain_answer = read_plain(plain, inputs, settings, runtime, sets) if plain else None
    log.info("compared drafter %s (%s): %s, K %s", name, drafter_dir, drafter.method, settings.ks)
    engine_args = (runtime, inputs.model_dtype, drafter.speculative_config, True, sets)
    engine_args = (*engine_args, None, plain_answer)  # no other thinking mode's group
    engine = engine_metrics(drafter_dir, inputs.prompts, inputs.cuts, settings, *engine_args)
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
