"""The engine side of the evaluation in vLLM (`evaluate.engine: vllm`): runs under vLLM's
interpreter, started by vllm_evaluate.py, once per evaluation.

    python -m eaglenest.vllm_engine.decode <requests.json>

`requests.json` is a list of configurations (plainly, and with each K), decoded in turn, each by
a fresh offline `vllm.LLM` that is shut down before the next starts: one process imports vLLM
once for all of them (~9 s of CPU an import here), where a process per configuration imported it
len(ks) + 1 times. Each engine decodes the held-out prompts (token ids) at temperature 0:
plainly, or with EAGLE-3 speculative decoding by the exported drafter and K draft tokens, and
answers one message (eaglenest.vllm_engine.process.say): the generated token ids per prompt, the
wall time of `generate`, and vLLM's own speculative-decoding counters (`vllm:spec_decode_*`),
which are the figures users see in production. The request's `groups` (name -> prompts; the
prompts cut at each depth) are decoded after, by the same engine, one `generate` each, with the
counters' growth over that call as the group's own.

A request's `speculative_config` (the drafter family's: EAGLE-3, P-EAGLE's eagle3 with
parallel_drafting, DFlash's method dflash) is vLLM's as given; without one, EAGLE-3 with the
request's `drafter` and `k`. Each speculative engine also counts rounds per request (vLLM's
`per_request_spec_decode_metrics`, v1/metrics/stats.py RequestSpecDecodeMetrics: the steps of
its histogram), so each prompt's rounds can be compared with our live loop's. A configuration
the CPU build cannot serve (cpu.py's CpuEngineError: a non-MLA drafter beside an MLA target) is
answered with `refused` and its reason, and the next one starts.

Imports vLLM and eaglenest.vllm_engine.process only.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

from eaglenest.vllm_engine.cpu import CpuEngineError
from eaglenest.vllm_engine.process import llm_arguments, one_shot_llm, say, start_group_watchdog

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_position",
}


def engine(request: dict):
    method = {"disable_log_stats": False}  # the spec_decode counters are stats
    if request["k"] is not None:
        method["speculative_config"] = request.get("speculative_config") or {
            "method": "eagle3",
            "model": request["drafter"],
            "num_speculative_tokens": request["k"],
        }
        method["per_request_spec_decode_metrics"] = "summary"
    return one_shot_llm(llm_arguments(request, **method), core_in_process=True)


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
    """Tokens, wall time and the counters' growth of one `generate` over `prompts`."""
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
    return answer


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
        llm = engine(request)
    except CpuEngineError as error:
        return {"done": True, "k": request["k"], "refused": str(error)}
    from vllm import SamplingParams

    say({"engine_ready_s": round(time.perf_counter() - started, 3), "k": request["k"]})
    sampling = SamplingParams(max_tokens=request["max_new_tokens"], temperature=0.0)
    answer = decode_prompts(llm, request["prompts"], sampling)
    groups = {
        name: decode_prompts(llm, prompts, sampling)
        for name, prompts in (request.get("groups") or {}).items()
    }
    shut_down(llm)
    return {"done": True, "k": request["k"], **answer, "groups": groups}


def main(requests_path: str) -> None:
    start_group_watchdog()  # first, while no thread runs: vLLM's processes die with this one
    for request in json.loads(Path(requests_path).read_text()):
        say(decode_request(request))
        gc.collect()  # the last engine's client, unreachable now, before the next one starts


if __name__ == "__main__":  # LLM(...) starts its workers with spawn
    main(sys.argv[1])
