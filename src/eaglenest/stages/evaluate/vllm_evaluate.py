"""Acceptance measured by the serving engine (`evaluate.engine: vllm`): the held-out prompts are
decoded by vLLM at temperature 0 once plainly and once per K with the exported drafter (its
family's `speculative_config`: EAGLE-3, P-EAGLE, DFlash), each in a fresh engine, the engines
one after another in one process (vllm_engine/decode.py under vLLM's interpreter). In the
pipeline the plain decoding is the run's one, made once for every evaluation (plain.py, the rule
decode_plain) and passed as `plain`; without it, it is decoded here first.

Per K: vLLM's acceptance length (1 + accepted / drafts), its per-position acceptance
(accepted at position i / drafts), the tokens, the wall time, and whether the speculative
outputs equal the plain ones prompt for prompt, which greedy speculative decoding promises.

Why a fresh engine per K and not one long-lived server, as the capture has (capture/server.py):
vLLM 0.32 fixes the speculative method, the drafter and `num_speculative_tokens` when the engine
starts (its SpeculativeConfig; SamplingParams has no per-request K), so a server would start the
same len(ks) + 1 engines. They start once per run, not once per shard: 3 starts for ks [3, 7]
(40-90 s each here; for Kimi-K2.5, three loads of its weights, against 50+ for an engine per
capture shard). The capture server cannot decode plainly either: its method writes every
request's states.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.formats.metrics import EngineFigures, emitted_per_round
from eaglenest.settings.evaluate import CompareSettings, EvaluateSettings, PlainSettings
from eaglenest.settings.vllm import VllmEngine, VllmRuntime
from eaglenest.stages.evaluate.depths import DepthCut
from eaglenest.stages.evaluate.sets import EngineSets
from eaglenest.stages.evaluate.spread import paired_difference, record_figures
from eaglenest.target_model.files import resolve_target_dir
from eaglenest.vllm_engine.process import (
    EngineError,
    engine_messages,
    engine_process,
    engine_python,
)

log = logging.getLogger(__name__)

# The settings the engines read: the evaluate job's, a compared drafter's, the plain decoding's.
EngineReadSettings = EvaluateSettings | CompareSettings | PlainSettings

DECODE_MODULE = "eaglenest.vllm_engine.decode"
HELDOUT = "heldout"  # the set name of the held-out prompts' figures (and of their depth cuts)


@dataclass(frozen=True)
class Sampling:
    """The engine's sampled decoding beside the greedy one: vLLM's rejection sampling at
    `temperature` (the run's generation.temperature; 0: greedy only), top_p 1, each prompt seeded
    with `seed` + its index (train.seed), so a rerun samples the same tokens; the bootstrap of
    the spread (spread.py) draws from `seed` too."""

    temperature: float = 0.0
    seed: int = 0

    def key(self) -> str:
        """How answers and metrics.json name the temperature (vllm_engine/decode.py's key)."""
        return f"{self.temperature:g}"


def draft_room(k: int | None) -> int:
    """Positions a K-draft engine needs past the longest prompt plus its new tokens to draft to
    the end. vLLM 0.32 drafts after a step only while the step's sequence (its K verified drafts
    included) plus K more fits in max_model_len (gpu_model_runner._input_fits_in_drafter); past
    that it schedules zero-id drafts, all rejected: one token a round, each counted as a round
    with nothing accepted. With max_model_len at prompt + new tokens, the longest answers lost
    drafting over their last ~2K positions (K=7 on the small demo: 247 rounds where the same
    drafts with room need 233, as our live loop; the same on the DeepSeek-V3 demo, MLA)."""
    return 2 * k if k else 0


def with_draft_room(request: dict[str, Any], runtime: VllmRuntime) -> dict[str, Any]:
    """`request` with room for its drafts when max_model_len was derived from the prompts; a
    `vllm.max_model_len` of the user's stays, with a warning when the longest answers cannot be
    drafted to their end (vLLM then decodes their last tokens without drafts)."""
    room = draft_room(request["k"])
    if not room:
        return request
    if runtime.max_model_len is None:
        return {**request, "max_model_len": request["max_model_len"] + room}
    every = [*request["prompts"], *[p for group in request["groups"].values() for p in group]]
    needed = max((len(p) for p in every), default=0) + request["max_new_tokens"] + room
    if needed > runtime.max_model_len:
        log.warning(
            "vllm.max_model_len %d is below the %d that K=%d needs to draft to the end of the "
            "longest answers: vLLM decodes their last tokens without drafts, one a round, and "
            "counts those rounds",
            runtime.max_model_len,
            needed,
            request["k"],
        )
    return request


def config_name(k: int | None) -> str:
    """How logs and files name a configuration: `plain`, `k3` ..."""
    return f"k{k}" if k is not None else "plain"


def decode_each(
    requests: list[dict[str, Any]], runtime: VllmRuntime, work_dir: Path
) -> list[dict[str, Any]]:
    """One engine per request (a configuration: `k` None for plain decoding), one after another
    in one process; their answers (tokens, wall time, counters), in order."""
    requests = [with_draft_room(request, runtime) for request in requests]
    python = engine_python(runtime.python)
    names = "+".join(config_name(request["k"]) for request in requests)
    path = work_dir / f"{names}.json"
    path.write_text(json.dumps(requests))
    env = {"VLLM_CPU_KVCACHE_SPACE": str(runtime.cpu_kvcache_space_gb)}
    tail: list[str] = []
    answers: list[dict[str, Any]] = []
    with engine_process(python, DECODE_MODULE, [str(path)], env) as process:
        for message in engine_messages(process, tail):
            if "engine_ready_s" in message:
                name = config_name(message["k"])
                log.info("vLLM (%s) ready after %.1f s", name, message["engine_ready_s"])
            elif message.get("done"):
                answers.append(message)
                if len(answers) == len(requests):
                    return answers
        code = process.wait()
    raise EngineError(
        f"vLLM decoding ({names}) ended (exit code {code}) after {len(answers)} of "
        f"{len(requests)} configurations; end of its log:\n" + "\n".join(tail)
    )


def decode(request: dict[str, Any], runtime: VllmRuntime, work_dir: Path) -> dict[str, Any]:
    """One engine, one configuration; its answer (tokens, wall time, counters)."""
    return decode_each([request], runtime, work_dir)[0]


def acceptance(answer: dict[str, Any], plain: dict[str, Any], k: int) -> dict[str, Any]:
    spec = answer["spec"]
    drafts = spec.get("drafts", 0)
    accepted_per_position = list(spec.get("accepted_per_position", [0] * k))
    tokens = sum(len(t) for t in answer["tokens"])
    figures = EngineFigures(
        acceptance_length=1 + spec.get("accepted_tokens", 0) / drafts if drafts else 1.0,
        rounds=drafts,
        rounds_per_prompt=answer.get("rounds_per_prompt"),
        # Kept with the rounds only (a speculative answer): what the report bootstraps over.
        emitted_per_prompt=(
            [len(t) - 1 for t in answer["tokens"]] if answer.get("rounds_per_prompt") else None
        ),
        per_position_acceptance=[a / drafts if drafts else 0.0 for a in accepted_per_position],
        accepted_per_position=accepted_per_position,
        drafted_per_position=[drafts] * k,
        draft_tokens=spec.get("draft_tokens", 0),
        accepted_tokens=spec.get("accepted_tokens", 0),
        tokens=tokens,
        prompts=len(answer["tokens"]),
        identical_to_plain=answer["tokens"] == plain["tokens"],
        spec_wall_s=answer["wall_s"],
        plain_wall_s=plain["wall_s"],
        speedup=None if plain["wall_s"] is None else plain["wall_s"] / max(answer["wall_s"], 1e-9),
    )
    return figures.to_json()


def engine_request(
    *,
    prompts: list[list[int]],
    drafter_dir: str | Path | None,
    target_path: str | Path,
    max_new_tokens: int,
    model_dtype: str,
    engine: VllmEngine,
    runtime: VllmRuntime,
    trust_remote_code: bool = False,
    groups: dict[str, list[list[int]]] | None = None,
    sampling: Sampling = Sampling(),
) -> dict[str, Any]:
    """What vllm_engine/decode.py is asked (less `k`: None for plain decoding, else the draft length).
    `groups`: further prompts by name (the depth cuts), each decoded by the same engine; every
    prompt list greedily, and sampled too when `sampling` has a temperature. `drafter_dir` None:
    a request for the plain engine only (`plain_request`), which names no drafter."""
    every = [*prompts, *[p for group in (groups or {}).values() for p in group]]
    longest = max((len(p) for p in every), default=0)
    drafter = {} if drafter_dir is None else {"drafter": str(Path(drafter_dir).resolve())}
    return {
        "target": str(target_path),
        **drafter,
        "prompts": prompts,
        "groups": groups or {},
        "max_new_tokens": max_new_tokens,
        "dtype": model_dtype,
        "tensor_parallel_size": runtime.tensor_parallel_size,
        "quantization": engine.quantization,
        "engine_args": engine.engine_args,
        "cpu_workarounds": engine.cpu_workarounds,
        "max_model_len": runtime.max_model_len or longest + max_new_tokens,
        "gpu_memory_utilization": runtime.gpu_memory_utilization,
        "trust_remote_code": trust_remote_code,
        "temperatures": [sampling.temperature] if sampling.temperature > 0 else [],
        "seed": sampling.seed,
    }


def sized_request(
    request: dict[str, Any], sets: EngineSets | None, runtime: VllmRuntime
) -> dict[str, Any]:
    """`request` sized for the sets' longest turns (sets.py), as it is without sets."""
    return sets.sized(request, runtime.max_model_len) if sets is not None else request


def plain_request(request: dict[str, Any], sets: EngineSets | None) -> dict[str, Any]:
    """The plain engine's request for the K engines' `request` (sized, before the sets' groups):
    the same prompts, groups, lengths, sampling, target and engine arguments, k None and no
    drafter (the plain engine reads none: stages/evaluate/plain.py decodes it once per run);
    with `sets`, their conversations too, answered turn by turn."""
    plain = {key: value for key, value in request.items() if key != "drafter"}
    return sets.plain_request(plain) if sets is not None else {**plain, "k": None}


def decode_sets_plainly(
    request: dict[str, Any],
    sets: EngineSets | None,
    plain: dict[str, Any] | None,
    runtime: VllmRuntime,
    work_dir: Path,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """With `sets`: the request sized for their longest turns, with their recorded prompts as
    groups, and the plain decoding that recorded them (decoded here, first, when not given: the
    sets' later turns follow its answers). Without: both as they are."""
    if sets is None:
        return request, plain
    request = sized_request(request, sets, runtime)
    plain = plain or decode(plain_request(request, sets), runtime, work_dir)
    return {**request, "groups": {**request["groups"], **sets.groups(plain)}}, plain


def evaluate_in_vllm(
    *,
    prompts: list[list[int]],
    drafter_dir: str | Path,
    target_path: str | Path,
    ks: tuple[int, ...],
    max_new_tokens: int,
    model_dtype: str,
    engine: VllmEngine,
    runtime: VllmRuntime,
    trust_remote_code: bool = False,
    plain: dict[str, Any] | None = None,
    depth_prompts: dict[str, list[list[int]]] | None = None,
    speculative_config: Callable[[str, int], dict[str, Any]] | None = None,
    refusal_is_a_reason: bool = False,
    sets: EngineSets | None = None,
    sampling: Sampling = Sampling(),
) -> dict[str, Any]:
    """vLLM's figures for every K, as `eval/metrics.json` records them under `engine`. `plain`:
    the plain decoding of the same prompts, when already made (`decode` with k None).
    `depth_prompts`: depth -> the prompts cut there, decoded by the same engines; their figures
    under `by_depth` (depth -> K -> figures). `speculative_config`: (drafter dir, K) -> vLLM's
    speculative_config (the drafter's family's; EAGLE-3's when None). A K the CPU build refuses
    to serve beside the target (an MLA target) is an EngineError, or with
    `refusal_is_a_reason` its reason under `not_served` (K -> reason), its figures absent.
    `sets`: the standard sets, decoded by the same engines (sets.py), their figures under `sets`.
    `sampling`: every prompt list also decoded sampled, its figures under `sampled`."""
    arguments = {"target_path": target_path, "max_new_tokens": max_new_tokens, "engine": engine}
    arguments |= {"model_dtype": model_dtype, "runtime": runtime, "sampling": sampling}
    arguments |= {"trust_remote_code": trust_remote_code, "depth_prompts": depth_prompts}
    request = request_of(prompts, drafter_dir, arguments)
    work_dir = Path(tempfile.mkdtemp(prefix="eaglenest-vllm-eval-"))
    by_depth: dict[str, dict[str, Any]] = {depth: {} for depth in depth_prompts or {}}
    not_served: dict[str, str] = {}
    try:
        request, plain = decode_sets_plainly(request, sets, plain, runtime, work_dir)
        configs = ([] if plain else [None]) + list(ks)
        requests = [{**request, "k": k} for k in ks]
        requests = ([] if plain else [plain_request(request, None)]) + requests
        for each in requests if speculative_config else ():
            if each["k"] is not None:
                each["speculative_config"] = speculative_config(request["drafter"], each["k"])
        answers = decode_each(requests, runtime, work_dir)
        by_config = dict(zip(configs, answers, strict=True))
        plain = plain or by_config[None]
        per_k, served = {}, {}
        at = figure_tables(per_k, by_depth, sampling)
        for k in ks:
            answer = by_config[k]
            if answer.get("refused"):
                if not refusal_is_a_reason:
                    raise EngineError(f"vLLM (K={k}): {answer['refused']}")
                not_served[str(k)] = answer["refused"]
                log.warning("vLLM does not serve K=%d here: %s", k, answer["refused"])
                continue
            served[k] = answer
            file_figures(at, answer, plain, k, max_new_tokens, sampling)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return {
        "engine": "vllm",
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "plain": {
            "tokens": sum(len(t) for t in plain["tokens"]),
            "wall_s": plain["wall_s"],
            **({"untimed": plain["untimed"]} if plain.get("untimed") else {}),
        },
        "per_k": per_k,
        "by_depth": by_depth,
        "not_served": not_served,
        "definition": "vLLM's spec_decode counters: acceptance length = 1 + accepted / drafts",
        "sets": sets.figures(served, plain, acceptance) if sets else {},
        **sampled_section(at, sampling),
    }


def figures_at_temperatures(
    answer: dict[str, Any], plain: dict[str, Any], k: int, max_new_tokens: int, sampling: Sampling
) -> dict[str, dict[str, Any]]:
    """One K's answer to one prompt list as figures, by temperature key: "0" greedy (as ever,
    with its temperature, set, spread and acceptance by position), then each sampled answer,
    with its difference from the greedy one on the same prompts (`vs_greedy`). A sampled
    output equals no plain one (identical_to_plain None); its speedup needs the plain engine's
    sampled decoding (None when `plain` was decoded greedily only)."""
    seed = sampling.seed
    figures = {"0": {**acceptance(answer, plain, k), "temperature": 0.0, "set": HELDOUT}}
    figures["0"].update(record_figures(answer, max_new_tokens, seed))
    for key, sampled in (answer.get("sampled") or {}).items():
        plain_sampled = (plain.get("sampled") or {}).get(key)
        each = acceptance(sampled, plain_sampled or sampled, k)
        each.update(identical_to_plain=None, temperature=float(key), set=HELDOUT, seed=seed)
        if plain_sampled is None:
            each.update(plain_wall_s=None, speedup=None)
        each.update(record_figures(sampled, max_new_tokens, seed))
        greedy_steps = answer.get("per_step_accepted") or []
        each["vs_greedy"] = paired_difference(sampled.get("per_step_accepted"), greedy_steps, seed)
        figures[key] = each
    return figures


def figure_tables(
    per_k: dict[str, Any], by_depth: dict[str, dict[str, Any]], sampling: Sampling
) -> dict[str, dict[str, Any]]:
    """Where evaluate_in_vllm files its figures: temperature key -> {"per_k": K -> figures,
    "by_depth": depth -> K -> figures}; "0" (greedy) holds `per_k` and `by_depth` themselves."""
    at = {"0": {"per_k": per_k, "by_depth": by_depth}}
    at.setdefault(sampling.key(), {"per_k": {}, "by_depth": {depth: {} for depth in by_depth}})
    return at


def file_figures(
    at: dict[str, dict[str, Any]],
    answer: dict[str, Any],
    plain: dict[str, Any],
    k: int,
    max_new_tokens: int,
    sampling: Sampling,
) -> None:
    """Files K's figures, of the held-out prompts and of each depth cut (the groups `at`'s
    by_depth names; the other groups are the sets'), under their temperature in `at`
    (evaluate_in_vllm's)."""
    for key, figures in figures_at_temperatures(answer, plain, k, max_new_tokens, sampling).items():
        at[key]["per_k"][str(k)] = figures
        log.info("vLLM K=%d, temperature %s: %s", k, key, in_brief(figures))
    for depth in at["0"]["by_depth"]:
        group, plain_group = answer["groups"][depth], plain["groups"][depth]
        in_group = figures_at_temperatures(group, plain_group, k, max_new_tokens, sampling)
        for key, figures in in_group.items():
            at[key]["by_depth"][depth][str(k)] = figures
            log.info("vLLM K=%d depth %s, temperature %s: %s", k, depth, key, in_brief(figures))


def in_brief(figures: dict[str, Any]) -> str:
    """One K's figures as its log line says them (metrics.json holds them whole: the per-step
    record and the spread make a line of kilobytes)."""
    identical = figures.get("identical_to_plain")
    same = "" if identical is None else f", {'equal to' if identical else 'NOT equal to'} plain"
    return (
        f"acceptance length {figures['acceptance_length']:.3f}, {figures['rounds']} rounds, "
        f"{figures['tokens']} tokens over {figures['prompts']} prompts{same}"
    )


def sampled_section(at: dict[str, dict[str, Any]], sampling: Sampling) -> dict[str, Any]:
    """metrics.json's engine `sampled` (absent at temperature 0): the temperature, top_p and
    seed, and the sampled figures by K and by depth."""
    if sampling.temperature <= 0:
        return {}
    settings = {"temperature": sampling.temperature, "top_p": 1.0, "seed": sampling.seed}
    return {"sampled": {**settings, **at[sampling.key()]}}


def engine_arguments(
    settings: EngineReadSettings,
    runtime: VllmRuntime | None,
    model_dtype: str,
    cuts: list[DepthCut],
    groups: dict[str, list[list[int]]] | None = None,
) -> dict[str, Any]:
    """evaluate_in_vllm's arguments that a stage's settings give (the held-out prompts', the
    drafter's and the K's apart): the target, lengths, engine, sampling and the prompt groups
    (each depth cut, then `groups`), for every engine of the run, the plain one's included."""
    return {
        "target_path": resolve_target_dir(settings.target.path),
        "max_new_tokens": settings.live_max_new_tokens,
        "model_dtype": model_dtype,
        "engine": settings.vllm,
        "runtime": runtime,
        "trust_remote_code": settings.target.trust_remote_code,
        "depth_prompts": {**{str(c.depth): c.prompts for c in cuts if c.prompts}, **(groups or {})},
        "sampling": Sampling(settings.sampled_temperature or 0.0, settings.seed),
    }


def request_of(
    prompts: list[list[int]], drafter_dir: str | Path | None, arguments: dict[str, Any]
) -> dict[str, Any]:
    """The K engines' request (before the sets size it) for `arguments` (evaluate_in_vllm's)."""
    return engine_request(
        prompts=prompts,
        drafter_dir=drafter_dir,
        target_path=arguments["target_path"],
        max_new_tokens=arguments["max_new_tokens"],
        model_dtype=arguments["model_dtype"],
        engine=arguments["engine"],
        runtime=arguments["runtime"],
        trust_remote_code=arguments.get("trust_remote_code", False),
        groups=arguments.get("depth_prompts"),
        sampling=arguments.get("sampling", Sampling()),
    )


def engine_metrics(
    drafter_dir: str | Path,
    prompts: list[list[int]],
    cuts: list[DepthCut],
    settings: EngineReadSettings,
    runtime: VllmRuntime | None,
    model_dtype: str,
    speculative_config: Callable[[str, int], dict[str, Any]] | None = None,
    refusal_is_a_reason: bool = False,
    sets: EngineSets | None = None,
    groups: dict[str, list[list[int]]] | None = None,
    plain: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """vLLM's figures (evaluate.engine: vllm) from the held-out prompts, each depth cut and the
    standard sets, with the emitted tokens per round of every K on the one definition
    (`evaluate_in_vllm` for the last four arguments); greedy, and sampled at the generation
    temperature (settings.sampled_temperature) with seeds from train.seed. `groups`: further
    prompt groups by name (the other thinking mode's), filed beside the depths in `by_depth`.
    `plain`: the run's plain decoding (plain.py), decoded here when None."""
    engine = evaluate_in_vllm(
        prompts=prompts,
        drafter_dir=drafter_dir,
        ks=settings.ks,
        **engine_arguments(settings, runtime, model_dtype, cuts, groups),
        speculative_config=speculative_config,
        refusal_is_a_reason=refusal_is_a_reason,
        sets=sets,
        plain=plain,
    )
    greedy_and_sampled = [engine, *([engine["sampled"]] if engine.get("sampled") else [])]
    for figures in greedy_and_sampled:
        for per_k in [figures["per_k"], *(figures.get("by_depth") or {}).values()]:
            for engine_k in per_k.values():
                engine_k["emitted_per_round"] = emitted_per_round(
                    engine_k["tokens"], engine_k["prompts"], engine_k["rounds"]
                )
    return engine


def live_vs_engine(live: dict[str, dict], engine: dict[str, dict]) -> dict[str, float | None]:
    """Per K: our live emitted tokens per round over the engine's, on that one definition."""
    ratios: dict[str, float | None] = {}
    for k, engine_k in engine.items():
        ours, theirs = live[k].get("emitted_per_round"), engine_k.get("emitted_per_round")
        ratios[k] = ours / theirs if ours is not None and theirs else None
    return ratios
