"""Acceptance of the drafter on held-out shards (the `evaluate` stage → eval/metrics.json):
simulated from stored features (simulated.py), live with the transformers target (live.py) and in
vLLM (vllm_evaluate.py), overall and by generated depth (depths.py).

Acceptance length = 1 + accepted draft tokens per verification round: the definition vLLM and
SGLang report (the target's own "bonus" token counts as the 1).

Every drafter family (`family`: its spec, settings/families.py; families.py) is measured the
same three ways at the K it serves, into the same metrics.json, which names the family and the K. vLLM's
CPU build serves no P-EAGLE or DFlash drafter beside an MLA target (vllm_engine/cpu.py): there
the engine figures are absent and `engine.not_served` says why; the live loop measures them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from eaglenest.capture.reader import PooledStates, open_pooled_shards
from eaglenest.common.devices import resolve_device
from eaglenest.common.io import write_json
from eaglenest.common.vllm_python import installed_vllm_version
from eaglenest.drafter.batches import TargetSignal, open_shards
from eaglenest.drafter.served_check import FLAG, check_drafter, enforce, read_config
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.formats.metrics import (
    DEFINITION,
    DepthTable,
    EngineRun,
    EvalMetrics,
    LiveFigures,
    SimulatedFigures,
    ThinkingFigures,
    by_k,
    live_over_simulated,
)
from eaglenest.formats.target_head import TargetHead
from eaglenest.settings.evaluate import EvaluateSettings
from eaglenest.settings.families import FAMILY_SPECS, FamilySpec, family_spec
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.settings.vllm_versions import MEASURED_VERSION
from eaglenest.stages.evaluate.depths import depth_table
from eaglenest.stages.evaluate.families import FamilyDrafter, load_family
from eaglenest.stages.evaluate.live import live_metrics
from eaglenest.stages.evaluate.plain import engine_inputs, read_plain
from eaglenest.stages.evaluate.sets import EngineSets
from eaglenest.stages.evaluate.simulated import simulate_all
from eaglenest.stages.evaluate.thinking import ThinkingEvaluation
from eaglenest.stages.evaluate.vllm_evaluate import engine_metrics, live_vs_engine
from eaglenest.target_model.files import resolve_target_dir

log = logging.getLogger(__name__)

BASELINES = ("untrained", "prompt_lookup")  # simulated beside the drafter (simulated.py)


def evaluate_drafter(
    *,
    drafter_dir: str | Path,
    heldout_hidden: list[str | Path],
    heldout_tokens: list[str | Path],
    target_head: str | Path,
    draft_vocab: str | Path,
    out: str | Path,
    settings: EvaluateSettings,
    runtime: VllmRuntime | None = None,
    hidden: HiddenSettings | None = None,
    family: FamilySpec | str = FAMILY_SPECS["eagle3"],
    sets: EngineSets | None = None,
    thinking: ThinkingEvaluation | None = None,
    plain: str | Path | None = None,
) -> dict[str, Any]:
    """The evaluate stage: simulated, live (evaluate.live) and vLLM (evaluate.engine) figures of
    the `family` drafter (its spec or name) in `drafter_dir`, at the K its spec serves; `sets`:
    standard sets (sets.py) decoded in vLLM; `thinking`: also the other thinking mode's prompts;
    `plain`: the run's plain decoding in vLLM (plain.py's file; decoded here when None).
    With `hidden` (hidden.store none/budget) and no `heldout_hidden`, the held-out states come
    from the capture servers (`runtime`), for the simulated figures, as training reads them."""
    family = family_spec(family)
    target_path, trust_remote_code = settings.target.path, settings.target.trust_remote_code
    served_check = check_served(drafter_dir, family.name, settings, runtime)  # before any work
    device = resolve_device(settings.device)
    started = time.perf_counter()
    head = TargetHead.load(target_head)
    vocab = DraftVocab.load(draft_vocab)
    # Each hidden shard's tokens shard is the same shard's: a stale pairing is refused.
    paired = heldout_tokens if len(heldout_tokens) == len(heldout_hidden) else None
    shards = open_shards(heldout_hidden, head, vocab, tokens=paired)
    pooled = heldout_tokens if hidden is not None and not heldout_hidden else []
    loaded = load_family(
        family, drafter_dir, head.embed, head.aux_layer_ids, settings.ks, head.lm_head
    )
    drafter = loaded.to(device).model
    settings = dataclasses.replace(settings, ks=loaded.ks)
    states = PooledStates.of_job(hidden, runtime, out, pooled, settings.max_batch_tokens)
    try:
        shards += open_pooled_shards(states, pooled, head, vocab)
        signal = TargetSignal(head, vocab, device)
        simulated = simulate_all(drafter, shards, signal, settings, device, family.name)
    finally:
        if states is not None:
            states.close()
    simulated_by_depth = simulated.pop("by_depth", {})
    # The prompts, cuts and the other thinking mode's prompts (`thinking`), as plain.py's job
    # builds them for the run's plain decoding.
    inputs = engine_inputs(heldout_tokens, settings, thinking)
    prompts, cuts, groups = inputs.prompts, inputs.cuts, inputs.groups
    model_dtype = inputs.model_dtype  # float32 on a CPU, as the capture and the demo run there
    log_cuts_and_simulated(cuts, simulated)
    live: dict[str, Any] = {}
    if settings.live:
        live_args = (settings, target_path, device, model_dtype, trust_remote_code)
        layers = list(drafter.config.aux_layer_ids)  # the target's layers it reads
        live_args = (*live_args, layers, cuts, family.name, groups)
        live = live_metrics(loaded.proposer, prompts, *live_args)
    engine: dict[str, Any] = {}
    if settings.engine == "vllm":
        # The run's plain decoding (decode_plain's file), checked to answer this job's request.
        plain_answer = read_plain(plain, inputs, settings, runtime, sets) if plain else None
        engine_args = (settings, runtime, model_dtype, loaded, family, sets, groups, plain_answer)
        engine = engine_figures(drafter_dir, prompts, cuts, live.get("live"), *engine_args)
    # The other thinking mode's figures, taken out of the live loop's groups and the engine's.
    decoded = {**live, **engine}
    thinking_figures = thinking.section(decoded) if thinking else None
    by_depth = by_depth_table(cuts, settings, simulated_by_depth, live, engine)
    heldout = heldout_hidden or heldout_tokens
    metrics = metrics_record(loaded, heldout, simulated, live, engine, thinking_figures, by_depth)
    wall_s = time.perf_counter() - started
    metrics = dataclasses.replace(metrics, served_check=served_check, wall_s=wall_s)
    write_json(out, metrics.to_json())
    return metrics.to_json()


def check_served(
    drafter_dir: str | Path, family: str, settings: EvaluateSettings, runtime: VllmRuntime | None
) -> list[dict[str, str]] | None:
    """The served check (drafter/served_check.py) of the drafter beside the target, at the length
    vLLM serves (vllm.max_model_len, else the target's own), by the vLLM of vllm.python (else
    the version the project's rules were read from); None with evaluate.served_check off. Only
    an evaluation that serves the drafter in vLLM (evaluate.engine) is refused: the others
    record every finding, as nothing is served there."""
    if settings.served_check == "off":
        return None
    version = installed_vllm_version(runtime.python) if runtime else None
    target = read_config(resolve_target_dir(settings.target.path))
    served = runtime.max_model_len if runtime else None
    findings = check_drafter(drafter_dir, target, served, family, version or MEASURED_VERSION)
    for finding in findings:
        log.warning("served check, %s (%s): %s", finding.severity, finding.key, finding.message)
    mode = settings.served_check if settings.engine == "vllm" else FLAG
    return enforce(findings, mode, f"{drafter_dir} ({family}) with evaluate.engine vllm")


def log_cuts_and_simulated(cuts: list, simulated: dict[str, Any]) -> None:
    """The depth cuts' counts, and each simulated proposer's acceptance per K."""
    for cut in cuts:
        log.info("depth %d: %s", cut.depth, cut.counts())
    for name, per_k in simulated.items():
        log.info(
            "simulated %s: %s",
            name,
            {k: round(v["acceptance_length"], 3) for k, v in per_k.items()},
        )


def by_depth_table(
    cuts: list,
    settings: EvaluateSettings,
    simulated_by_depth: dict[str, Any],
    live: dict[str, Any],
    engine: dict[str, Any],
) -> DepthTable | None:
    """depths.py's table of every measurement by depth (None without evaluate.depths); the
    engine's figures by depth, greedy and sampled, taken out of its section in every case."""
    engine_by_depth = (engine.get("engine") or {}).pop("by_depth", None)
    sampled_by_depth = ((engine.get("engine") or {}).get("sampled") or {}).pop("by_depth", None)
    if not settings.depths:
        return None
    measured = (simulated_by_depth, live.get("live_by_depth"), engine_by_depth, sampled_by_depth)
    return depth_table(cuts, settings.ks, settings.live_max_new_tokens, *measured)


def metrics_record(
    loaded: FamilyDrafter,
    heldout: list[str | Path],
    simulated: dict[str, Any],
    live: dict[str, Any],
    engine: dict[str, Any],
    thinking: ThinkingFigures | None,
    by_depth: DepthTable | None,
) -> EvalMetrics:
    """eval/metrics.json assembled from each measurement's figures: the simulated ones (the
    drafter's under its family's name, the baselines'), the live loop's (`live_metrics`; none
    when evaluate.live is false), the engine's (`engine_figures`; none without one) and both
    thinking modes' (thinking.py); `by_depth`: depths.py's table (none without evaluate.depths)."""
    family = loaded.family
    live_k = by_k(LiveFigures, live["live"], "live") if live else None
    simulated_k = by_k(SimulatedFigures, simulated[family], "simulated")
    return EvalMetrics(
        **loaded.describe(),
        heldout_shards=[Path(p).stem for p in heldout],
        definition=DEFINITION,
        simulated=simulated_k,
        baselines={name: by_k(SimulatedFigures, simulated[name], name) for name in BASELINES},
        live=live_k,
        live_baselines={
            name: by_k(LiveFigures, figures, name)
            for name, figures in live["live_baselines"].items()
        }
        if live
        else None,
        live_skipped_reason=None if live else "evaluate.live is false",
        live_vs_simulated=live_over_simulated(live_k, simulated_k) if live_k is not None else None,
        engine=EngineRun.from_json(engine["engine"], "engine") if engine else None,
        live_vs_engine=engine.get("live_vs_engine"),
        sets=engine.get("sets"),
        thinking=thinking,
        by_depth=by_depth,
    )


def engine_figures(
    drafter_dir: str | Path,
    prompts: list[list[int]],
    cuts: list,
    live: dict[str, Any] | None,
    settings: EvaluateSettings,
    runtime: VllmRuntime | None,
    model_dtype: str,
    loaded: FamilyDrafter,
    family: FamilySpec,
    sets: EngineSets | None,
    groups: dict[str, list[list[int]]] | None = None,
    plain: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """metrics.json's `engine` (vLLM's figures), `live_vs_engine` beside the `live` figures, and
    `sets` (the standard sets' figures, taken out of the engine's) when there are sets; `groups`
    (the other thinking mode's prompts) decoded by the same engines, under `by_depth`; `plain`:
    the run's plain decoding (plain.py), decoded here when None."""
    # A refusal is a reason for a parallel family: EAGLE-3 has an MLA drafter for MLA targets.
    engine_args = (runtime, model_dtype, loaded.speculative_config, family.parallel, sets)
    engine_args = (*engine_args, groups, plain)
    figures = {"engine": engine_metrics(drafter_dir, prompts, cuts, settings, *engine_args)}
    if live:
        figures["live_vs_engine"] = live_vs_engine(live, figures["engine"]["per_k"])
    set_figures = figures["engine"].pop("sets", None)
    if sets is not None:
        figures["sets"] = set_figures
    return figures
