"""DeepSeek-V3, the architecture inside Kimi-K2 and Kimi-K2.5 (MLA attention, MoE with a shared
expert, the first layer dense), through every target-facing stage in a real vLLM (the CPU build,
.venv-vllm): config/tests/deepseek-v3.yaml run by the conftest's `deepseek_run`."""

from __future__ import annotations

import json

from support.vllm import DEEPSEEK_RUN


def test_the_deepseek_v3_demo_runs_through_vllm(deepseek_run):
    """Generation from vLLM's server (token ids exact), capture by vLLM after the backend check
    passed on every layer, an MLA drafter decoded by vLLM at K=3 and 7 in the rounds our live
    loop needs (within one a prompt), both outputs equal to plain greedy decoding."""
    workdir, _ = deepseek_run
    run = workdir / "results" / DEEPSEEK_RUN
    target = json.loads((run / "target" / "config.json").read_text())
    assert target["architectures"] == ["DeepseekV3ForCausalLM"]
    assert target["kv_lora_rank"] == 512 and target["n_routed_experts"] == 8
    for shard in ("00000", "00001"):
        report = json.loads((run / "tokens" / f"{shard}.report.json").read_text())
        assert report["agreement"]["share"] == 1.0, report["agreement"]
        assert json.loads((run / "hidden" / f"{shard}.json").read_text())["backend"] == "vllm"
    verify = json.loads((run / "hidden" / "verify.json").read_text())
    print(
        "vLLM vs transformers per layer:",
        {k: v["max_relative"] for k, v in verify["layers"].items()},
    )
    assert verify["passed"] and set(verify["layers"]) == {"2", "4", "5", "final"}
    assert verify["largest"] < 1e-4
    drafter = json.loads((run / "drafter" / "config.json").read_text())
    assert drafter["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
    metrics = json.loads((run / "eval" / "metrics.json").read_text())
    engine = metrics["engine"]
    for k in ("3", "7"):
        vllm, live = engine["per_k"][k], metrics["live"][k]
        print(f"DeepSeek-V3 K={k}: vLLM {vllm['acceptance_length']:.4f} ({vllm['rounds']} rounds),"
              f" live {live['acceptance_length']:.4f} ({live['rounds']} rounds)")  # fmt: skip
        assert vllm["identical_to_plain"] and live["identical_to_greedy"]
        assert vllm["tokens"] == live["tokens"] == engine["plain"]["tokens"]
        # 110 and 88 rounds both here. Before the engine left room for the drafts past prompt +
        # answer (vllm_evaluate.draft_room), vLLM needed 92 at K=7, its first drafts accepted
        # less often (54 against our 56): the zero drafts it verified over the longest answers'
        # last positions.
        assert abs(vllm["rounds"] - live["rounds"]) <= vllm["prompts"]
        first = vllm["accepted_per_position"][0] - live["accepted_per_position"][0]
        assert abs(first) <= vllm["prompts"], (vllm["accepted_per_position"], live)
    page = (run / "report" / "index.html").read_text()
    assert "vLLM against transformers" in page
