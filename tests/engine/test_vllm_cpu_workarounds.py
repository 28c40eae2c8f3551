"""vLLM's CPU build and what eaglenest.vllm_engine.cpu does about it, against the real engine
(.venv-vllm): the rotary bug in its smallest form, and the DeepSeek-V3 backend check failing
without the fix (the conftest's DeepSeek-V3 target, on `kimi_run`'s token shards). The fix's
arguments without vLLM: tests/unit/vllm_engine/test_vllm_cpu.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.vllm import DEEPSEEK, VLLM_PYTHON, require_vllm_venv


def test_the_cpu_rotary_custom_op_rotates_3d_inputs_wrongly():
    """The bug eaglenest.vllm_engine.cpu works around, in its smallest form (docs/vllm-cpu.md, known
    issues): vLLM's CPU rotary custom op on [tokens, heads, 64] inputs, as MLA hands it q_pe and
    k_pe, against vLLM's own PyTorch rotary; flattened to 2-D it agrees. When this fails, vLLM
    has fixed it and the workaround can go."""
    require_vllm_venv()
    done = subprocess.run(
        [VLLM_PYTHON, str(Path(__file__).with_name("vllm_rotary_repro.py"))],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if "per query head" in line}
    print("\n".join(lines.values()))
    per_head = {name: json.loads(line.split(":", 1)[1]) for name, line in lines.items()}
    assert max(per_head["3-D"]) > 0.1
    assert max(per_head["2-D"]) < 1e-5


def test_the_backend_check_fails_on_deepseek_v3_without_the_cpu_fix(
    deepseek_target_dir, kimi_run, tmp_path
):
    """The same check with vLLM's rotary custom op left on (vllm.cpu_workarounds false; CPU_MLA
    named by hand so that the engine starts at all on AMX CPUs): it fails, naming the layers and
    their figures, which are orders of magnitude above those of the run with the fix."""
    from dataclasses import replace

    from eaglenest.common.config import settings_from_sections
    from eaglenest.settings.hidden_states import HiddenSettings, HiddenVerifySettings
    from eaglenest.settings.vllm import VllmEngine, VllmRuntime
    from eaglenest.stages.hidden_states.verify import BackendMismatchError, verify_backends

    hidden = DEEPSEEK["hidden"]
    engine = settings_from_sections(VllmEngine, vllm={
        "cpu_workarounds": False,
        "engine_args": {"enforce_eager": True, "attention_backend": "CPU_MLA"},
    })  # fmt: skip
    settings = settings_from_sections(
        HiddenSettings, hidden=hidden, target={"path": str(deepseek_target_dir)}
    )
    settings = replace(settings, engine=engine)
    with pytest.raises(BackendMismatchError) as failure:
        verify_backends(
            tokens=kimi_run["run"] / "tokens" / "00000.parquet",
            out=tmp_path / "verify.json",
            settings=settings,
            verify=settings_from_sections(HiddenVerifySettings, hidden=hidden),
            runtime=settings_from_sections(VllmRuntime, vllm={"python": VLLM_PYTHON}),
        )
    message = str(failure.value)
    print("without the CPU fix:", message)
    assert "hidden.verify_tolerance" in message and "2: " in message and "final: " in message
    assert not (tmp_path / "verify.json").exists()
