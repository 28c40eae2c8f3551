"""The CPU fixes of every vLLM the pipeline starts (eaglenest.vllm_engine.cpu), without vLLM: what
they add to an engine's arguments, what they refuse, and the server flags docs/vllm-cpu.md shows."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from eaglenest.vllm_engine.cpu import (
    CpuEngineError,
    config_uses_mla,
    cpu_engine_args,
    server_flags,
)

REPO = Path(__file__).resolve().parents[3]


def test_the_rotary_custom_op_is_turned_off_and_other_ops_are_left_as_asked():
    """Nothing else changes: a dense target keeps vLLM's default custom ops (none when compiled,
    the figures of earlier rounds), a user's own list keeps its other entries, and a rotary op
    the user turned on is turned off all the same."""
    dense = cpu_engine_args({"max_num_seqs": 1}, target_uses_mla=False)
    assert dense == {"max_num_seqs": 1, "compilation_config": {"custom_ops": ["-rotary_embedding"]}}
    own = cpu_engine_args(
        {"compilation_config": {"mode": 0, "custom_ops": ["all", "+rotary_embedding", "-silu"]}},
        target_uses_mla=False,
    )
    assert own["compilation_config"] == {"mode": 0, "custom_ops": ["all", "-silu",
                                                                   "-rotary_embedding"]}  # fmt: skip


def test_an_mla_target_gets_the_reference_mla_backend_and_an_mla_drafter_beside_it():
    args = cpu_engine_args(
        {"speculative_config": {"method": "eagle3", "model": "d"}},
        target_uses_mla=True,
        drafter_uses_mla=True,
    )
    assert args["attention_backend"] == "CPU_MLA"
    assert args["speculative_config"] == {"attention_backend": "CPU_MLA", "method": "eagle3",
                                          "model": "d"}  # fmt: skip
    named = cpu_engine_args({"attention_backend": "AMX_MLA"}, target_uses_mla=True)
    assert named["attention_backend"] == "AMX_MLA"  # a backend the user names is kept
    with pytest.raises(CpuEngineError, match="train.drafter.attention: mla"):
        cpu_engine_args({}, target_uses_mla=True, drafter_uses_mla=False)


def test_mla_is_read_from_the_config_or_its_text_config():
    assert config_uses_mla({"kv_lora_rank": 512})
    assert config_uses_mla({"architectures": ["KimiK25ForConditionalGeneration"],
                            "text_config": {"kv_lora_rank": 512}})  # fmt: skip
    assert not config_uses_mla({"num_key_value_heads": 8})


def test_server_flags_and_the_readme_command_are_the_engines_own():
    """`eaglenest vllm-cpu-flags --mla` prints what the pipeline's engines get, in a form a shell
    takes; the CPU serving command of docs/vllm-cpu.md carries exactly that."""
    flags = server_flags(cpu_engine_args({"enforce_eager": True}, target_uses_mla=True))
    assert flags == ["--enforce-eager", "--compilation-config",
                     '{"custom_ops":["-rotary_embedding"]}', "--attention-backend", "CPU_MLA"]  # fmt: skip
    printed = subprocess.run(
        [sys.executable, "-m", "eaglenest.cli", "vllm-cpu-flags", "--mla"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert shlex.split(printed) == flags[1:]
    assert printed in (REPO / "docs" / "vllm-cpu.md").read_text()
    assert json.loads(shlex.split(printed)[1]) == {"custom_ops": ["-rotary_embedding"]}
