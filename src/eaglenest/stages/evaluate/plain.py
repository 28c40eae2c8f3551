"""The run's plain decoding in vLLM (`evaluate.engine: vllm`; the rule decode_plain →
eval_plain/decoding.json): the held-out prompts, their depth cuts, the other thinking mode's
prompts and the standard sets' conversations decoded by the target alone, once per run, where
every evaluate_drafter job (one per family of train.families) and every evaluate_compare job
started a plain engine of its own before its K engines: the same prompts, target, lengths,
engine arguments and sampling each time, so N loads of the target where one serves. It depends
on no drafter and on no K: it runs beside training, and a change of evaluate.ks leaves it.

What the engines decode is built here once, for the plain job and the evaluate jobs alike
(`engine_inputs`, `run_plain_request`: the held-out prompts, cuts and groups, then
vllm_evaluate's request), so the two cannot drift. The file holds the plain engine's answer as
vllm_evaluate.decode returns it (tokens, wall_s, groups, sampled, sets) and the `request` it
answered; an evaluate job rebuilds that request and refuses a file that answered another
(`read_plain`), naming the file. A compared drafter's engines decode the held-out prompts and
cuts without the other thinking mode's group: they read the groups they decode from the file
(the plain engine decodes each prompt list on its own, from an empty prefix cache).
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.common.devices import resolve_device
from eaglenest.common.io import write_json
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.evaluate.depths import DepthCut, cut_at_depths
from eaglenest.stages.evaluate.live import heldout_prompts
from eaglenest.stages.evaluate.sets import EngineSets
from eaglenest.stages.evaluate.thinking import ThinkingEvaluation
from eaglenest.stages.evaluate.vllm_evaluate import (
    EngineReadSettings,
    decode,
    engine_arguments,
    plain_request,
    request_of,
    sized_request,
)

log = logging.getLogger(__name__)

# Request keys that place the engine (vllm.* runtime settings, untracked by the rules) and do not
# change a greedy plain decoding that fits: a run that changes them and retrains a drafter keeps
# its plain decoding.
PLACEMENT_KEYS = frozenset({"tensor_parallel_size", "gpu_memory_utilization", "max_model_len"})
# Those of them that change the engine's speed: a plain decoding placed otherwise (or on another
# host) gives its tokens and no speed-up.
TIMED_PLACEMENT_KEYS = ("tensor_parallel_size", "gpu_memory_utilization")


@dataclass(frozen=True)
class EngineInputs:
    """What every engine of a run's evaluation decodes, from the held-out tokens: the prompts,
    their depth cuts, the other thinking mode's prompt group ({} without one) and the dtype."""

    prompts: list[list[int]]
    cuts: list[DepthCut]
    groups: dict[str, list[list[int]]]
    model_dtype: str


def engine_inputs(
    heldout_tokens: list[str | Path],
    settings: EngineReadSettings,
    thinking: ThinkingEvaluation | None,
) -> EngineInputs:
    """The held-out prompts (evaluate.live_prompts of them), cut at evaluate.depths, and with
    `thinking` (evaluate.thinking_modes) rendered in the other mode; float32 on a CPU, as the
    capture and the demo run there."""
    prompts = heldout_prompts(heldout_tokens, settings.live_prompts)
    continuation = settings.live_max_new_tokens
    cuts = cut_at_depths(heldout_tokens, settings.depths, settings.live_prompts, continuation)
    groups = thinking.groups(prompts) if thinking else {}
    model_dtype = "float32" if resolve_device(settings.device) == "cpu" else "auto"
    return EngineInputs(prompts, cuts, groups, model_dtype)


def run_plain_request(
    inputs: EngineInputs,
    settings: EngineReadSettings,
    runtime: VllmRuntime | None,
    sets: EngineSets | None,
) -> dict[str, Any]:
    """The plain engine's request of the run, as JSON holds it: the K engines' request before
    its drafter (every group: the cuts, the other thinking mode's), sized for the sets, with
    their conversations (vllm_evaluate.plain_request). No draft room: that is the K engines'."""
    arguments = engine_arguments(settings, runtime, inputs.model_dtype, inputs.cuts, inputs.groups)
    request = sized_request(request_of(inputs.prompts, None, arguments), sets, runtime)
    return json.loads(json.dumps(plain_request(request, sets)))


def decode_plain(
    *,
    heldout_tokens: list[str | Path],
    out: str | Path,
    settings: EngineReadSettings,
    runtime: VllmRuntime,
    sets: EngineSets | None = None,
    thinking: ThinkingEvaluation | None = None,
) -> dict[str, Any]:
    """The decode_plain job: the run's plain decoding by one vLLM engine, written to `out` with
    the request it answered; returned as the evaluate jobs read it (`read_plain`)."""
    inputs = engine_inputs(heldout_tokens, settings, thinking)
    request = run_plain_request(inputs, settings, runtime, sets)
    work_dir = Path(tempfile.mkdtemp(prefix="eaglenest-vllm-plain-"))
    try:
        answer = decode(request, runtime, work_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    tokens = sum(len(t) for t in answer["tokens"])
    log.info("plain decoding: %d tokens in %.1f s", tokens, answer["wall_s"])
    write_json(out, {**answer, "host": socket.gethostname(), "request": request})
    return answer


def read_plain(
    path: str | Path,
    inputs: EngineInputs,
    settings: EngineReadSettings,
    runtime: VllmRuntime | None,
    sets: EngineSets | None,
) -> dict[str, Any]:
    """The plain decoding in `path` (decode_plain's file), as vllm_evaluate's `plain`, once the
    request it answered is the one this job would have decoded (prompts, groups, lengths,
    sampling, target, engine arguments, sets; not PLACEMENT_KEYS); another is a ValueError naming
    the file and the keys that differ (a bug: rules/evaluate.smk gives both jobs the same
    settings). Decoded on another host or placement (a cluster's nodes), its wall times are
    dropped (`untimed`): a speed-up from two machines' clocks compares nothing."""
    record = json.loads(Path(path).read_text())
    answered = record.pop("request", None) or {}
    host = record.pop("host", None)
    expected = run_plain_request(inputs, settings, runtime, sets)
    differing = sorted(
        key
        for key in {*answered, *expected} - PLACEMENT_KEYS
        if answered.get(key) != expected.get(key)
    )
    if differing:
        raise ValueError(
            f"{path}: the plain decoding answered another request than this job decodes (it "
            f"differs in {', '.join(differing)}): decode_plain and the evaluate jobs must read "
            "the same settings (rules/evaluate.smk); delete the file to decode it again"
        )
    here = socket.gethostname()
    apart = [f"host {host}, this job's {here}"] if host not in (None, here) else []
    apart += [
        f"{key} {answered.get(key)}, this job's {expected.get(key)}"
        for key in TIMED_PLACEMENT_KEYS
        if answered.get(key) != expected.get(key)
    ]
    if apart:
        reason = f"{path} was decoded apart ({'; '.join(apart)}): no speed-up against it"
        log.warning("%s", reason)
        return {**untimed(record), "untimed": reason}
    return record


def untimed(answer: Any) -> Any:
    """`answer` with every wall time (its own, its groups', its sets', sampled) None."""
    if isinstance(answer, dict):
        return {k: None if k == "wall_s" else untimed(v) for k, v in answer.items()}
    if isinstance(answer, list):
        return [untimed(v) for v in answer]
    return answer
