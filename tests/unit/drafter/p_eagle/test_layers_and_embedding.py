"""P-EAGLE at its references' operating point (eaglenest.drafter.p_eagle): several decoder
layers and a trained mask embedding. The training forward of a 4-layer drafter against a
step-by-step computation of vLLM's Eagle3 Llama forward (layer 0 over 2H, layers > 0 over H, the
residual carried as vLLM's fused add-norms carry it), and against the decoding cache; the mask
embedding's gradient; checkpointing per layer; the export round trip of every layer and the
embedding, and the refusal of an embedding vLLM would read as another."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from support.drafter_sizes import CONFIG

from eaglenest.drafter.export_files import ExportError
from eaglenest.drafter.layers import DecodeCache, apply_rope, rope_cos_sin
from eaglenest.drafter.p_eagle.export import export_p_eagle, load_p_eagle
from eaglenest.drafter.p_eagle.model import PEagleDrafter

MASK = 49
LAYERS = 4


def make_model(layers: int = LAYERS, train_mask_embedding: bool = True) -> PEagleDrafter:
    torch.manual_seed(0)
    model = PEagleDrafter(CONFIG, MASK, layers, train_mask_embedding).double()
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
        for name, p in model.named_parameters():
            if p.ndim == 1 and name != "mask_hidden":  # norms away from 1, a trained delta
                p.uniform_(0.5, 1.5)
    return model.eval()


def inputs(batch: int = 1, length: int = 12):
    torch.manual_seed(1)
    aux = torch.randn(batch, length, 3 * CONFIG.target_hidden_size, dtype=torch.float64)
    ids = torch.randint(0, CONFIG.vocab_size, (batch, length))
    return aux, ids


def attend(attn, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of one sequence [S, in] with Llama's rotary embedding."""
    c = CONFIG
    s = x.shape[0]
    cos, sin = rope_cos_sin(positions[None], c.head_dim, c.rope_theta)
    q = apply_rope(attn.q_proj(x).view(1, s, -1, c.head_dim).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(1, s, -1, c.head_dim).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(1, s, -1, c.head_dim).transpose(1, 2)
    groups = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attn.o_proj(out.transpose(1, 2).reshape(s, -1))


def vllm_forward(model: PEagleDrafter, tokens, hidden, positions) -> torch.Tensor:
    """LM-head input [S, H] of vLLM's Eagle3 LlamaModel.forward (llama_eagle3.py), step by step:
    layer 0 takes cat(input_layernorm(embed), hidden_norm(h)) [2H]; every layer returns
    (mlp output, residual) and the next adds them before its input_layernorm; the final norm adds
    the last pair. Embeddings from the table the export carries (the trained mask row)."""
    table = model.embed_tokens.weight.clone()
    table[MASK] = model.mask_embedding()
    first = model.midlayer
    residual = hidden
    x = torch.cat([first.input_layernorm(table[tokens]), first.hidden_norm(hidden)], -1)
    out = attend(first.self_attn, x, positions)
    residual = out + residual
    out = first.mlp(first.post_attention_layernorm(residual))
    for layer in model.layers.values():
        residual = out + residual
        out = attend(layer.self_attn, layer.input_layernorm(residual), positions)
        residual = out + residual
        out = layer.mlp(layer.post_attention_layernorm(residual))
    return model.norm(out + residual)


def parallel_round(model: PEagleDrafter, aux, ids, t: int, k: int):
    """vLLM's parallel-drafting round at EAGLE-3 position t: tokens x_1..x_t+1 then K-1 masks,
    hidden fc(aux_0..aux_t) then fc(mask_hidden) (v1/spec_decode/utils.py:429-541)."""
    tokens = torch.cat([ids[1 : t + 2], torch.full((k - 1,), MASK)])
    hidden = torch.cat(
        [model.project(aux[: t + 1]), model.project(model.mask_hidden)[None].expand(k - 1, -1)]
    )
    return tokens, hidden, torch.arange(t + k)


def test_a_four_layer_parallel_forward_equals_vllms_layers_step_by_step():
    model = make_model()
    assert len(model.midlayer.self_attn.q_proj.weight[0]) == 2 * CONFIG.hidden_size
    assert all(
        len(x.self_attn.q_proj.weight[0]) == CONFIG.hidden_size for x in model.layers.values()
    )
    aux, ids = inputs()
    k = 4
    with torch.no_grad():
        depths = model(aux, ids, k)
        for t in (0, 4, 8):
            tokens, hidden, positions = parallel_round(model, aux[0], ids[0], t, k)
            expected = model.lm_head(vllm_forward(model, tokens, hidden, positions))[t:]
            # Our live loop's decoding cache: the verified part first, the masks after it.
            cache = DecodeCache()
            model.step(
                tokens[None, : t + 1], hidden[None, : t + 1], positions[None, : t + 1], cache
            )
            decoded, _ = model.step(
                tokens[None, t + 1 :], hidden[None, t + 1 :], positions[None, t + 1 :], cache
            )
            assert len(cache.deeper) == LAYERS - 1 and len(cache.layer(3)) == t + k
            for d in range(k):
                torch.testing.assert_close(depths[d][0, t], expected[d], rtol=1e-9, atol=1e-9)
                if d:
                    torch.testing.assert_close(decoded[0, d - 1], expected[d])
            cache.truncate(t + 1)
            assert all(len(cache.layer(i)) == t + 1 for i in range(LAYERS))


def synthetic_loss(model: PEagleDrafter, aux, ids) -> torch.Tensor:
    return sum(logits.logsumexp(-1).mean() for logits in model(aux, ids, 3))


@pytest.mark.parametrize("trained", [True, False])
def test_the_mask_embedding_learns_only_when_trained(trained):
    model = make_model(train_mask_embedding=trained).train()
    aux, ids = inputs(batch=2)
    synthetic_loss(model, aux, ids).backward()
    assert not model.embed_tokens.weight.requires_grad and model.embed_tokens.weight.grad is None
    if trained:
        assert model.mask_embedding_delta.grad.abs().sum() > 0
    else:
        assert model.mask_embedding_delta is None
        assert "mask_embedding_delta" not in dict(model.named_parameters())
    # Every layer learns (DDP would refuse an unused parameter).
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_activation_checkpointing_per_layer_changes_nothing_but_memory():
    aux, ids = inputs(batch=2)
    grads = []
    for checkpointed in (False, True):
        model = make_model().train()
        model.checkpoint_layer = checkpointed
        synthetic_loss(model, aux, ids).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_the_export_keeps_every_layer_and_the_trained_embedding(tmp_path):
    model = make_model()
    target = model.embed_tokens.weight.float().clone()
    export_p_eagle(model, tmp_path, depths=4, dtype="float32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == LAYERS
    assert config["eaglenest"]["train_mask_embedding"] is True
    tensors = load_file(str(tmp_path / "model.safetensors"))
    # vLLM's names: midlayer. -> layers.0.; layers > 0 over H, without hidden_norm.
    for i in range(1, LAYERS):
        assert tensors[f"layers.{i}.self_attn.q_proj.weight"].shape[1] == CONFIG.hidden_size
        assert f"layers.{i}.hidden_norm.weight" not in tensors
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * CONFIG.hidden_size
    assert "mask_embedding_delta" not in tensors
    table = tensors["embed_tokens.weight"]
    torch.testing.assert_close(table[MASK], model.mask_embedding().float())
    assert not torch.equal(table[MASK], target[MASK])  # vLLM keeps it as the draft's own
    others = torch.arange(CONFIG.vocab_size) != MASK
    assert torch.equal(table[others], target[others])
    loaded, depths = load_p_eagle(tmp_path, target, [2, 4, 5])
    assert (depths, loaded.num_hidden_layers, loaded.train_mask_embedding) == (4, LAYERS, True)
    aux, ids = inputs(batch=2)
    ids[0, 3] = MASK  # a mask token among the verified ones embeds as vLLM embeds it too
    with torch.no_grad():
        for a, b in zip(
            loaded(aux.float(), ids, 4), model.float()(aux.float(), ids, 4), strict=True
        ):
            torch.testing.assert_close(a, b)


def test_an_embedding_vllm_would_read_as_another_is_refused(tmp_path):
    model = make_model()
    target = model.embed_tokens.weight.float().clone()
    export_p_eagle(model, tmp_path, depths=4, dtype="float32")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    changed = {**tensors, "embed_tokens.weight": tensors["embed_tokens.weight"].clone()}
    changed["embed_tokens.weight"][3] += 1.0
    save_file(changed, str(tmp_path / "model.safetensors"))
    with pytest.raises(ExportError, match="rows other than the mask token's"):
        load_p_eagle(tmp_path, target)
    del changed["embed_tokens.weight"]
    save_file(changed, str(tmp_path / "model.safetensors"))
    with pytest.raises(ExportError, match="vLLM would embed the mask token with the target"):
        load_p_eagle(tmp_path, target)
    frozen = make_model(layers=2, train_mask_embedding=False)
    export_p_eagle(frozen, tmp_path, depths=4, dtype="float32")
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "model.safetensors"))
    loaded, _ = load_p_eagle(tmp_path, target)
    assert loaded.num_hidden_layers == 2 and not loaded.train_mask_embedding
    save_file(
        {**tensors, "mask_hidden": tensors["mask_hidden"]}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(ExportError, match="was not trained"):
        load_p_eagle(tmp_path, target)
