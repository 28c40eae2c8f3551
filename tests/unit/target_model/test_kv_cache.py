"""The growing KV cache (target_model/kv_cache.py): the same keys and values as transformers'
DynamicCache, so the same logits at every step, rows leaving the batch and cropped drafts
included, while it appends in place into buffers that double instead of copying the cache every
step."""

from __future__ import annotations

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from eaglenest.target_model.kv_cache import growing_cache


def test_the_growing_cache_gives_dynamic_caches_logits_and_grows_by_doubling():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    prompt = torch.randint(0, 64, (3, 5))
    caches = {"dynamic": DynamicCache(config=config), "growing": growing_cache(model)}
    logits = {name: [] for name in caches}
    with torch.no_grad():
        for name, cache in caches.items():
            step = prompt
            for i in range(150):
                out = model(input_ids=step, past_key_values=cache, use_cache=True)
                logits[name].append(out.logits[:, -1])
                step = out.logits[:, -1:].argmax(-1)
                if i == 70:  # a row finished: the batch keeps the others
                    keep = torch.tensor([0, 2])
                    cache.batch_select_indices(keep)
                    step = step[keep]
                if i % 20 == 10:  # rejected drafts: three positions written, then dropped
                    model(input_ids=step.repeat(1, 3), past_key_values=cache, use_cache=True)
                    cache.crop(-3)
            assert cache.get_seq_length() == 5 + 149
    for a, b in zip(logits["dynamic"], logits["growing"], strict=True):
        assert torch.equal(a, b)
    layer = caches["growing"].layers[0]
    assert layer.keys.shape[-2] == 154 <= layer.buffers[0].shape[-2] <= 2 * 154
