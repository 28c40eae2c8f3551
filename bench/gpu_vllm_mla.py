"""bench/gpu_check.py's `vllm_mla_dflash` step: a DFlash drafter beside an MLA target in vLLM.

Kimi-K2.5 is DeepSeek-V3 (MLA) with YaRN x64 from 4,096; its DFlash drafter (z-lab's
Kimi-K2.5-DFlash, eaglenest's dflash family) is Qwen3 attention. vLLM's CPU build cannot serve
the two together (CPU_MLA's block size 16 against CPU_ATTN's multiples of 32: "No common block
size", docs/vllm-cpu.md), so only a GPU tells whether vLLM serves what eaglenest trains for Kimi.

The step builds, with the project's own functions, a tiny random DeepSeek-V3 target with Kimi's
kind of YaRN over a small unscaled range (64 positions) and an untrained DFlash export beside it
(`target_rope_scaling`, `export_dflash`: the target's rope_parameters and positions), then, in a
child process of a python with vLLM (`--vllm-python`, else this one when it has vLLM), greedy
decodes a few prompts past the unscaled range plainly and with the DFlash drafter: served, the
two outputs must be equal and vLLM must have drafted. On the CPU the engine is expected to refuse
(the figures say why); on a GPU a refusal fails the step. Without vLLM the step is skipped.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

# Kimi-K2.5's YaRN keys (its text_config's rope_scaling), over 64 unscaled positions instead of
# 4,096 so that a short decode runs past them.
YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 64,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
# vLLM's MLA kernels take kv_lora_rank 512 + qk_rope_head_dim 64 (CPU_MLA, FlashMLA); the MoE
# sizes are multiples of 32.
TARGET = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
          "moe_intermediate_size": 64, "n_routed_experts": 8, "num_experts_per_tok": 2,
          "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
          "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128,
          "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
          "vocab_size": 512, "max_position_embeddings": 4096, "rope_theta": 50000.0,
          "tie_word_embeddings": False}  # fmt: skip
AUX_LAYER_IDS = (1, 2, 3)
BLOCK_SIZE = 8  # z-lab's Kimi-K2.5-DFlash: K = 7
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(40)] for i in range(3)]
NEW_TOKENS = 64  # to position 104: past the 64 unscaled positions

CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams

def main():
    spec = json.loads(sys.argv[1])
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    sampling = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
    answers = {}
    # DFlash first: where vLLM refuses it (its CPU build) no plain engine is started.
    for name, speculative in (("dflash", spec["speculative_config"]), ("plain", None)):
        llm = LLM(model=spec["target"], skip_tokenizer_init=True, speculative_config=speculative,
                  **spec["engine_args"])
        outputs = llm.generate(prompts, sampling)
        counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                    if m.name.startswith("vllm:spec_decode_num_")}
        answers[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                         "counters": counters}
        del llm
    print("ANSWER " + json.dumps(answers))

if __name__ == "__main__":
    main()
"""


def build_target(out: Path) -> Path:
    """The tiny DeepSeek-V3 with YaRN, saved in Hugging Face layout (no tokenizer: vLLM is given
    token ids)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    yarn = {k: v for k, v in YARN.items() if k != "rope_type"}
    config = DeepseekV3Config(**TARGET, rope_scaling={"type": "yarn", **yarn})
    DeepseekV3ForCausalLM(config).save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    # vLLM's DeepSeek-V3 gate has its correction bias with sigmoid noaux_tc routing only.
    saved.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    return out


def export_dflash_beside(target_dir: Path, out: Path) -> dict[str, Any]:
    """An untrained DFlash drafter sized from the target as the train stage sizes it (Qwen3
    attention, the target's YaRN and positions), exported as vLLM loads it; its config.json."""
    import torch
    from transformers import AutoConfig

    from eaglenest.drafter.config import DrafterConfig
    from eaglenest.drafter.dflash.export import export_dflash
    from eaglenest.drafter.dflash.model import DFlashConfig, DFlashDrafter, target_rope_scaling

    target = AutoConfig.from_pretrained(target_dir)
    vocab = target.vocab_size
    base = DrafterConfig.from_target(target, draft_vocab_size=vocab, aux_layer_ids=AUX_LAYER_IDS)
    config = DFlashConfig.from_drafter(
        base,
        num_hidden_layers=1,
        block_size=BLOCK_SIZE,
        mask_token_id=vocab - 1,
        rope_scaling=target_rope_scaling(target),
    )
    torch.manual_seed(1)
    model = DFlashDrafter(config)
    model.set_vocab(torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
    export_dflash(model, out, dtype="bfloat16")
    return json.loads((out / "config.json").read_text())


def run(root: Path, python: str, cuda: bool, timeout_s: float) -> dict[str, Any]:
    """The figures of the step; raises AssertionError where vLLM on a GPU does not serve the
    DFlash drafter beside the MLA target as plain greedy decoding."""
    target = build_target(root / "target")
    exported = export_dflash_beside(target, root / "dflash")
    assert exported["rope_parameters"]["rope_type"] == "yarn", exported["rope_parameters"]
    figures: dict[str, Any] = {"positions": len(PROMPTS[0]) + NEW_TOKENS}
    # disable_log_stats False: the spec-decode counters (get_metrics) are kept.
    engine_args = {"dtype": "bfloat16", "enforce_eager": True, "max_model_len": 512,
                   "max_num_seqs": len(PROMPTS), "disable_log_stats": False}  # fmt: skip
    if cuda:
        engine_args["gpu_memory_utilization"] = 0.3
    else:  # what eaglenest's engine sets on the CPU (vllm_engine/cpu.py)
        engine_args.update(dtype="float32", attention_backend="CPU_MLA",
                           compilation_config={"custom_ops": ["-rotary_embedding"]})  # fmt: skip
    spec = {"target": str(target), "prompts": PROMPTS, "new_tokens": NEW_TOKENS,
            "engine_args": engine_args,
            "speculative_config": {"method": "dflash", "model": str(root / "dflash"),
                                   "num_speculative_tokens": BLOCK_SIZE - 1}}  # fmt: skip
    script = root / "vllm_mla_dflash.py"
    script.write_text(CHILD)
    done = subprocess.run(
        [python, str(script), json.dumps(spec)],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    answer = [line for line in done.stdout.splitlines() if line.startswith("ANSWER ")]
    if not answer:
        # The root cause is the first error vLLM logs (the engine core's failure follows it).
        errors = [line for line in done.stderr.splitlines() if "Error: " in line]
        figures["served"] = False
        figures["reason"] = (errors[0] if errors else done.stderr[-300:]).strip()[-300:]
        assert not cuda, f"vLLM did not serve DFlash beside the MLA target: {figures['reason']}"
        # The CPU build's refusal, as docs/vllm-cpu.md says (CPU_MLA: [16]; CPU_ATTN: 32s).
        assert "No common block size" in figures["reason"], figures["reason"]
        return figures
    answers = json.loads(answer[0].removeprefix("ANSWER "))
    counters = answers["dflash"]["counters"]
    figures.update(served=True, drafts=counters.get("vllm:spec_decode_num_drafts"),
                   accepted=counters.get("vllm:spec_decode_num_accepted_tokens"))  # fmt: skip
    figures["identical_to_plain"] = answers["dflash"]["tokens"] == answers["plain"]["tokens"]
    assert figures["identical_to_plain"], "DFlash's greedy output differs from plain greedy"
    assert (figures["drafts"] or 0) > 0, f"vLLM drafted nothing: {counters}"
    return figures
