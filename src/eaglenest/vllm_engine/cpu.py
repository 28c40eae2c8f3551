"""What vLLM's CPU build needs to compute what its GPU build computes, decided once for every
engine the pipeline starts (capture, evaluation: process.llm_arguments) and for every
server started by hand or by the tests (`server_flags`). On GPUs nothing changes.

- **Rotary embedding.** Where vLLM uses its custom ops (`enforce_eager`, or `custom_ops` with
  `all`; compiled runs default to none), the CPU wrapper of the `rotary_embedding` custom op
  (csrc/cpu/pos_encoding.cpp in vLLM 0.32) takes `stride(-2)` as the token stride and
  `size(-1) / head_size` as the head count. MLA (model_executor/layers/mla.py) hands it strided
  3-D views (q_pe [T, heads, 64], k_pe [T, 1, 64] sliced from the fused projection), so it
  rotates the wrong rows: the states of an MLA model (DeepSeek-V3, Kimi-K2) drift from the first
  layer on (0.7-1.3 relative at layer 1 on the trained DeepSeek-V3 demo, eager) and decoding
  attends with them. vLLM's PyTorch rotary (`-rotary_embedding`) is right; dense models are the
  same either way. docs/vllm-cpu.md, known issues, has the smallest reproduction.
- **MLA backend.** On a CPU with AMX, vLLM picks AMX_MLA for MLA models, which takes only bf16,
  fp16 or quantised weights; the reference CPU_MLA takes all dtypes and runs on every CPU, so
  features and acceptance do not depend on which CPU ran them. A drafter beside an MLA target
  must be an MLA drafter there: CPU_MLA's block size (16) is one CPU_ATTN (multiples of 32)
  cannot use ("No common block size for 16"; a DFlash drafter beside the DeepSeek-V3 target,
  the refusal bypassed, failed so at engine start: "No common block size for 128 (CPU_MLA: [16];
  CPU_ATTN: [MultipleOf(32)])", Dec 2026). P-EAGLE and DFlash have no MLA drafter, so they are
  not served beside an MLA target here; GPUs serve a llama drafter beside one.

Standard library only: the engine side imports this under vLLM's interpreter.
"""

from __future__ import annotations

import json
from typing import Any

ROTARY_OP = "rotary_embedding"
MLA_BACKEND = "CPU_MLA"


class CpuEngineError(ValueError):
    """A configuration vLLM's CPU build cannot run; the message says what to change."""


def without_custom_rotary(compilation_config: dict[str, Any] | None) -> dict[str, Any]:
    """`compilation_config` with vLLM's rotary custom op off, every other op as asked or as
    vLLM's default (off when compiled with inductor, on with enforce_eager: the bug shows there,
    or wherever custom ops are turned on)."""
    config = dict(compilation_config or {})
    ops = [op for op in config.get("custom_ops") or [] if op.lstrip("+-") != ROTARY_OP]
    config["custom_ops"] = [*ops, "-" + ROTARY_OP]
    return config


def cpu_engine_args(
    args: dict[str, Any], *, target_uses_mla: bool, drafter_uses_mla: bool | None = None
) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments (or a server's, as a dict) with the CPU fixes merged in.
    `drafter_uses_mla`: None when no EAGLE-3 drafter is loaded."""
    args = dict(args)
    args["compilation_config"] = without_custom_rotary(args.get("compilation_config"))
    if target_uses_mla:
        args.setdefault("attention_backend", MLA_BACKEND)
        if drafter_uses_mla is False:
            raise CpuEngineError(
                "an MLA target (DeepSeek-V3, Kimi-K2) on vLLM's CPU build is served only beside "
                f"an MLA drafter: its {MLA_BACKEND} block size of 16 is one the Llama drafter's "
                "CPU attention cannot use (vLLM: 'No common block size'); an EAGLE-3 drafter "
                "trained with train.drafter.attention: mla is. P-EAGLE and DFlash are llama/Qwen3 "
                "attention (vLLM has no MLA parallel drafter): vLLM serves them beside this "
                "target on GPUs, and here the evaluate stage's live loop measures them"
            )
    if drafter_uses_mla and "speculative_config" in args:
        args["speculative_config"] = {
            "attention_backend": MLA_BACKEND,
            **args["speculative_config"],
        }
    return args


def config_uses_mla(config: dict[str, Any]) -> bool:
    """Whether a model's config.json (or its `text_config`, as Kimi-K2.5 nests it) is MLA."""
    text = config.get("text_config") or config
    return bool(text.get("kv_lora_rank"))


def server_flags(args: dict[str, Any]) -> list[str]:
    """`vllm serve` / `python -m vllm.entrypoints.openai.api_server` flags for engine arguments:
    `{"attention_backend": "CPU_MLA"}` -> `--attention-backend CPU_MLA`, dicts as JSON, False
    as `--no-...` (vLLM's boolean options take both forms), None left to vLLM's default."""
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        elif value is not None:
            text = (
                json.dumps(value, separators=(",", ":"))
                if isinstance(value, dict | list)
                else value
            )
            flags += [flag, str(text)]
    return flags


def add_arguments(parser: Any) -> None:
    parser.add_argument("--mla", action="store_true", help="the target is MLA (DeepSeek-V3, Kimi)")


def run(args: Any) -> int:
    """`eaglenest vllm-cpu-flags`: the server flags as a shell would take them (JSON quoted), to
    add to a `vllm serve` command line on CPU."""
    import shlex

    flags = server_flags(cpu_engine_args({}, target_uses_mla=args.mla))
    print(" ".join(shlex.quote(flag) for flag in flags))
    return 0
