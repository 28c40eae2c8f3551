"""The engine side of the evaluation in vLLM (`evaluate.engine: vllm`): runs under vLLM's
interpreter, started by vllm_evaluate.py, once per evaluation.

    python -m eaglenest.vllm_engine.decode <requests.json>

`requests.json` is a list of configurations (plainly, and with each K), decoded in turn, each by
a fresh offline `vllm.LLM` that is shut down before the next starts: one process imports vLLM
once for all of them (~9 s of CPU an import here), where a process per configuration imported it
len(ks) + 1 times. Each engine decodes the held-out prompts (token ids) at temperature 0, and
at the request's sampling temperatures (below):
plainly, or with EAGLE-3 speculative decoding by the exported drafter and K draft tokens, and
answers one message (eaglenest.vllm_engine.process.say): the generated token ids per prompt, the
wall time of `generate`, and vLLM's own speculative-decoding counters (`vllm:spec_decode_*`),
which are the figures users see in production. The request's `groups` (name -> prompts; the
prompts cut at each depth) are decoded after, by the same engine, one `generate` each, with the
counters' growth over that call as the group's own.

Each prompt list (the held-out prompts, every group) is decoded greedily first, then once at
each of the request's `temperatures` (vLLM's rejection sampling; temperature is per request, so
the same engine), each prompt with its own seed (`seed` + its index: the same prompt list
samples the same tokens again); the sampled answers under `sampled` (temperature -> answer).

A request's `speculative_config` (the drafter family's: EAGLE-3, P-EAGLE's eagle3 with
parallel_drafting, DFlash's method dflash) is vLLM's as given; without one, EAGLE-3 with the
request's `drafter` and `k`. Each speculative engine also keeps each request's record (vLLM's
`per_request_spec_decode_metrics: detailed`, v1/metrics/stats.py RequestSpecDecodeMetrics): the
rounds per prompt (the steps of its histogram), and the accepted and drafted counts of every
step in order (`per_step_accepted`, `per_step_drafted`), from which the figures' spread over
prompts and acceptance by generated position come (stages/evaluate/spread.py). A configuration
the CPU build cannot serve (cpu.py's CpuEngineError: a non-MLA drafter beside an MLA target) is
answered with `refused` and its reason, and the next one starts. A plain request's `sets` (the
standard sets' conversations) are decoded turn by turn after (conversations.py).

Imports vLLM and eaglenest.vllm_engine.process only (and the CPU build's fixes: cpu_expand.py,
cpu_generators.py; process.py applies cpu_kernel_scan.py).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

from eaglenest.vllm_engine.conversations import decode_sets
from eaglenest.vllm_engine.cpu import CpuEngineError
from eaglenest.vllm_engine.cpu_expand import fix_cpu_expand_kernel
from eaglenest.vllm_engine.cpu_generators import fix_cpu_generator_offsets
from eaglenest.vllm_engine.process import llm_arguments, one_shot_llm, say, start_group_watchdog

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_position",
}


def decode_engine(request: dict):
    # Sampled verification on vLLM's CPU build reads a temperature it never wrote (cpu_expand.py),
    # and a seeded request prefilled in chunks ends it (cpu_generators.py).
    fix_cpu_expand_kernel()
    fix_cpu_generator_offsets()
    method = {"disable_log_stats": False}  # the spec_decode counters are stats
    if request["k"] is not None:
        method["speculative_config"] = request.get("speculative_config") or {
            "method": "eagle3",
            "model": request["drafter"],
            "num_speculative_tokens": request["k"],
        }
        method["per_request_spec_decode_metrics"] = "detailed"
    return one_shot_llm(llm_arguments(request, **method))


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters, summed over engines (one per data-parallel rank)."""
    found: dict = {}
    for metric in llm.get_metrics():
        name = SPEC_COUNTERS.get(metric.name)
        if name is None:
            continue
        value = getattr(metric, "values", None)
        if value is None:
            value = getattr(metric, "value", 0)
        if isinstance(value, list):
            previous = found.get(name, [0] * len(value))
            found[name] = [a + b for a, b in zip(previous, value, strict=True)]
        else:
            found[name] = found.get(name, 0) + value
    return found


def counters_since(after: dict, before: dict) -> dict:
    """The growth of vLLM's counters between two readings (lists element by element)."""
    grown: dict = {}
    for name, value in after.items():
        previous = before.get(name)
        if isinstance(value, list):
            previous = previous or [0] * len(value)
            grown[name] = [a - b for a, b in zip(value, previous, strict=True)]
        else:
            grown[name] = value - (previous or 0)
    return grown


def decode_prompts(llm, prompts: list[list[int]], sampling) -> dict:
    """Tokens, wall time and the counters' growth of one `generate` over `prompts`, decoded from
    an empty prefix cache, so a list's figures do not depend on the lists decoded before it (seen
    without: the thinking-off prompts, which extend the held-out ones, decoded first gave one
    held-out prompt the same tokens in 47 rounds against 35; a seeded sampled decoding, whose
    draws follow the rounds, would not repeat either)."""
    llm.reset_prefix_cache()
    before = spec_counters(llm)
    tick = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], sampling, use_tqdm=False)
    wall_s = time.perf_counter() - tick
    answer = {
        "tokens": [list(output.outputs[0].token_ids) for output in outputs],
        "wall_s": round(wall_s, 4),
        "spec": counters_since(spec_counters(llm), before),
    }
    per_request = [getattr(output.outputs[0], "spec_decode_metrics", None) for output in outputs]
    if all(metrics is not None for metrics in per_request):
        answer["rounds_per_prompt"] = [sum(metrics.histogram) for metrics in per_request]
        answer["per_step_accepted"] = [list(m.per_step_accepted) for m in per_request]
        answer["per_step_drafted"] = [list(m.per_step_drafted) for m in per_request]
    return answer


def sampling_arguments(request: dict, temperature: float, prompts: int) -> list[dict]:
    """SamplingParams' arguments for each of `prompts` prompts: greedy at temperature 0 (one
    for all), else sampled, each prompt with its own seed (the request's `seed` + its index), so
    a prompt list decoded again samples the same tokens."""
    if temperature == 0:
        return [{"max_tokens": request["max_new_tokens"], "temperature": 0.0}]
    tokens = request["max_new_tokens"]
    return [
        {"max_tokens": tokens, "temperature": temperature, "seed": request["seed"] + index}
        for index in range(prompts)
    ]


def decode_at_temperatures(llm, prompts: list[list[int]], request: dict) -> dict:
    """The greedy answer of `prompts`, with one sampled answer per temperature of the request's
    `temperatures` under `sampled` ("0.7" -> answer) when it lists any."""
    from vllm import SamplingParams

    def at(temperature: float) -> dict:
        arguments = sampling_arguments(request, temperature, len(prompts))
        sampling = [SamplingParams(**each) for each in arguments]
        return decode_prompts(llm, prompts, sampling if len(sampling) > 1 else sampling[0])

    answer = at(0.0)
    temperatures = [t for t in request.get("temperatures") or () if t > 0]
    if temperatures:
        answer["sampled"] = {temperature_key(t): at(t) for t in temperatures}
    return answer


def temperature_key(temperature: float) -> str:
    """How answers and metrics.json name a temperature: "0.7", "1"."""
    return f"{temperature:g}"


def shut_down(llm) -> None:
    """Stops the engine core's process (and its memory: the KV cache, the weights) before the
    next engine starts."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None:
        core.shutdown()


def decode_request(request: dict) -> dict:
    """One engine, one configuration: its answer message."""
    started = time.perf_counter()
    try:
        llm = decode_engine(request)
    except CpuEngineError as error:
        return {"done": True, "k": request["k"], "refused": str(error)}
    from vllm import SamplingParams

    say({"engine_ready_s": round(time.perf_counter() - started, 3), "k": request["k"]})
    sampling = SamplingParams(max_tokens=request["max_new_tokens"], temperature=0.0)
    answer = decode_at_temperatures(llm, request["prompts"], request)
    groups = {
        name: decode_at_temperatures(llm, prompts, request)
        for name, prompts in (request.get("groups") or {}).items()
    }
    if request.get("sets"):  # the plain engine: the standard sets' conversations, turn by turn
        answer["sets"] = decode_sets(llm, request["sets"], sampling)
    shut_down(llm)
    return {"done": True, "k": request["k"], **answer, "groups": groups}


def main(requests_path: str) -> None:
    start_group_watchdog()  # first, while no thread runs: vLLM's processes die with this one
    for request in json.loads(Path(requests_path).read_text()):
        say(decode_request(request))
        gc.collect()  # the last engine's client, unreachable now, before the next one starts


if __name__ == "__mp_main__":  # this module re-imported by an engine core vLLM spawned
    fix_cpu_expand_kernel()
    fix_cpu_generator_offsets()
if __name__ == "__main__":  # LLM(...) starts its workers with spawn
    main(sys.argv[1])
