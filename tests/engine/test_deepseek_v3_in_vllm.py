"""DeepSeek-V3, the architecture inside Kimi-K2 and Kimi-K2.5 (MLA attention, MoE with a shared
expert, the first layer dense), in a real vLLM (the CPU build, .venv-vllm). The lane runs one
whole pipeline on it, in Kimi-K2.5's layout (conftest.py's `kimi_run`, asserted in
test_kimi_k25_layout.py: generation from vLLM's server with exact ids, capture by vLLM, the MLA
drafter decoded by vLLM at K=3 and 7). Here the plain layout of the same target
(`DeepseekV3ForCausalLM`, config/tests/deepseek-v3.yaml, as `snakemake --configfile
config/tests/deepseek-v3.yaml` builds it) is held to what vLLM computes for it: every captured
layer equal to transformers on that run's samples."""

from __future__ import annotations

import json
from dataclasses import replace

from support.vllm import DEEPSEEK, DEEPSEEK_RUN, EAGER, VLLM_PYTHON


def test_the_deepseek_v3_demo_target_has_the_kimi_k2_architecture(
    deepseek_workdir, deepseek_target_dir
):
    """MLA at the only latent size vLLM's CPU kernel takes, routed experts with a shared one;
    built by the pipeline's rule (the suite's one trained build through Snakemake: the small
    demo's target is built once by the library and copied into `finished_run`), logged."""
    workdir, _ = deepseek_workdir
    log = (workdir / "logs" / DEEPSEEK_RUN / "build_demo_target.log").read_text()
    assert "held-out: well-formed 1.00" in log and "demo target written to" in log, log[-2000:]
    target = json.loads((deepseek_target_dir / "config.json").read_text())
    assert target["architectures"] == ["DeepseekV3ForCausalLM"]
    assert target["kv_lora_rank"] == 512 and target["qk_rope_head_dim"] == 64
    assert target["n_routed_experts"] == 8 and target["n_shared_experts"] >= 1
    assert target["first_k_dense_replace"] == 1


def test_vllm_captures_the_plain_deepseek_v3_layout_as_transformers(
    deepseek_target_dir, kimi_run, tmp_path
):
    """The pipeline's backend check (hidden.verify_samples) on the plain layout, with the CPU
    fixes the pipeline applies: vLLM's hidden states equal transformers' on layers 1, 2, 3 and
    the final one, as on the Kimi-K2.5 layout of the same weights in `kimi_run`."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.settings.hidden_states import HiddenSettings, HiddenVerifySettings
    from eaglenest.settings.vllm import VllmEngine, VllmRuntime
    from eaglenest.stages.hidden_states.verify import verify_backends

    hidden = DEEPSEEK["hidden"]
    settings = settings_from_sections(
        HiddenSettings, hidden=hidden, target={"path": str(deepseek_target_dir)}
    )
    engine = settings_from_sections(VllmEngine, vllm={"engine_args": EAGER})
    result = verify_backends(
        tokens=kimi_run["run"] / "tokens" / "00000.parquet",
        out=tmp_path / "verify.json",
        settings=replace(settings, engine=engine),
        verify=settings_from_sections(HiddenVerifySettings, hidden=hidden),
        runtime=settings_from_sections(VllmRuntime, vllm={"python": VLLM_PYTHON}),
    )
    print("plain DeepSeek-V3, vLLM vs transformers per layer:",
          {k: v["max_relative"] for k, v in result["layers"].items()})  # fmt: skip
    assert result["passed"] and set(result["layers"]) == {"1", "2", "3", "final"}
    assert result["largest"] < 1e-4
    assert result["samples"] == hidden["verify_samples"]
