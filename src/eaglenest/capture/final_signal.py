"""The target signal of the loss from the output of the target's last decoder layer, as the
vLLM capture gives it (layer N, before the final norm): the final norm, then the LM head for
top-k. Used by the capture stage (stages/hidden_states/vllm_backend.py) and by the jobs that ask
the capture servers for states (capture/reader.py), so both compute the same signal."""

from __future__ import annotations

from pathlib import Path

import torch

from eaglenest.common.devices import resolve_device
from eaglenest.formats.hidden_shard import TOPK_CHUNK_ROWS
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.target_model.checkpoint import checkpoint_head_tensors


class FinalSignal:
    """The target signal from layer N's states: the final norm, then the LM head for top-k.

    The LM head runs on `hidden.device` (auto: the first GPU when there is one): Kimi-K2.5's is
    163,840 x 7168, 2.3 GFLOP a token, hours of CPU time a shard. It moves there at the first
    sample, once vLLM holds its share of the GPU memory (vLLM checks the free memory as it
    starts; 2.3 GB fits in what its default gpu_memory_utilization leaves)."""

    def __init__(self, target_dir: Path, model_config, settings: HiddenSettings):
        tied = bool(getattr(model_config, "tie_word_embeddings", False))
        tensors, tied = checkpoint_head_tensors(target_dir, tied)
        self.norm = tensors["norm.weight"]
        self.eps = float(model_config.rms_norm_eps)
        self.settings = settings
        self.device = resolve_device(settings.device)
        if settings.target_signal == "topk":
            self.head = tensors["embed_tokens.weight" if tied else "lm_head.weight"]

    def rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        """As transformers' Llama/Qwen RMSNorm: in float32, cast back, then the weight."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm * h.to(x.dtype)

    def __call__(self, last_layer: torch.Tensor) -> dict[str, torch.Tensor]:
        final = self.rms_norm(last_layer)
        if self.settings.target_signal != "topk":
            return {"final_hidden": final}
        self.head = self.head.to(self.device)  # a no-op after the first sample
        values, ids = [], []
        for chunk in final.split(TOPK_CHUNK_ROWS):
            logits = chunk.to(self.device, self.head.dtype) @ self.head.T
            top = torch.topk(logits.float(), self.settings.top_k)
            values.append(top.values.cpu())
            ids.append(top.indices.to(torch.int32).cpu())
        return {"topk_ids": torch.cat(ids), "topk_values": torch.cat(values)}
