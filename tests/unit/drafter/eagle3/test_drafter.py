"""The drafter model and its objective on small random sizes: the training-time-test attention
pattern against a plain loop and against the [T, T] implementation it replaced (loss and
gradients), decoding against training, and the loss mask."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from support.drafter_sizes import CONFIG

import eaglenest.drafter.attention as attention_module
import eaglenest.drafter.eagle3.model as drafter_module
from eaglenest.drafter.batches import Batch
from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.eagle3.model import Eagle3Drafter, ttt_forward
from eaglenest.drafter.layers import Attention, DecodeCache, rope_cos_sin, shift_left
from eaglenest.settings.families import DRAFTER_VARIANTS
from eaglenest.stages.train.loss import ttt_loss

# The original layout, each EAGLE-3 variant alone, and all of them at once.
VARIANTS = {
    "plain": {},
    **{name: {name: True} for name in DRAFTER_VARIANTS},
    "all": dict.fromkeys(DRAFTER_VARIANTS, True),
}


@pytest.fixture
def model() -> Eagle3Drafter:
    return make_model(CONFIG)


def make_model(config: DrafterConfig) -> Eagle3Drafter:
    torch.manual_seed(0)
    m = Eagle3Drafter(config).double()
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
        for p in m.parameters():
            if p.ndim == 1:  # norms: away from 1 so a swapped norm shows
                p.uniform_(0.5, 1.5)
    d2t = torch.arange(0, 2 * CONFIG.draft_vocab_size, 2) - torch.arange(CONFIG.draft_vocab_size)
    t2d = torch.zeros(CONFIG.vocab_size, dtype=torch.bool)
    t2d[torch.arange(0, 2 * CONFIG.draft_vocab_size, 2)] = True
    m.set_vocab(d2t, t2d)
    return m.eval()


def inputs(batch: int = 2, length: int = 9):
    torch.manual_seed(1)
    aux = torch.randn(batch, length, 3 * CONFIG.target_hidden_size, dtype=torch.float64)
    ids = torch.randint(0, CONFIG.vocab_size, (batch, length))
    return aux, ids


def reference_ttt(model: Eagle3Drafter, aux, ids, steps: int) -> list[torch.Tensor]:
    """The EAGLE-3 pattern written out: the query of step i at position t attends to the step-0
    keys at positions 0..t and to the keys of steps 1..i at position t, nothing else."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    b, t = ids.shape
    groups = CONFIG.num_attention_heads // CONFIG.num_key_value_heads
    hidden = model.fc(aux)
    keys, values, out_logits = [], [], []
    for i in range(steps):
        emb = model.embed_tokens(shift_left(ids, 1 + i))
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        cos, sin = rope_cos_sin(
            torch.arange(t).expand(b, t) + i, CONFIG.head_dim, CONFIG.rope_theta
        )
        q, k, v = attn._project(x, cos, sin)
        keys.append(k.repeat_interleave(groups, 1))
        values.append(v.repeat_interleave(groups, 1))
        out = torch.zeros_like(q)
        for pos in range(t):
            ks = torch.cat(
                [keys[0][:, :, : pos + 1], *[kj[:, :, pos : pos + 1] for kj in keys[1:]]], 2
            )
            vs = torch.cat(
                [values[0][:, :, : pos + 1], *[vj[:, :, pos : pos + 1] for vj in values[1:]]], 2
            )
            scores = (q[:, :, pos : pos + 1] @ ks.transpose(-1, -2)) / math.sqrt(CONFIG.head_dim)
            out[:, :, pos : pos + 1] = scores.softmax(-1) @ vs
        h = hidden + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        out_logits.append(model.lm_head(model.norm(h)))
        hidden = h
    return out_logits


def test_ttt_attention_equals_a_plain_loop_over_steps(model):
    aux, ids = inputs()
    with torch.no_grad():
        fast = ttt_forward(model, aux, ids, 4)
        slow = reference_ttt(model, aux, ids, 4)
    for step, (a, b) in enumerate(zip(fast, slow, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"TTT step {step}")


def dense_ttt_attention(self: Attention, x, cos, sin, cache):
    """The [T, T] attention the linear-memory one replaced (the test oracle only): one score block
    for the step-0 keys, one column per earlier step, a softmax over all of them."""
    q, k, v = self._project(x, cos, sin)
    cache.keys.append(k)
    cache.values.append(v)
    keys = [self._expand(key) for key in cache.keys]
    values = [self._expand(value) for value in cache.values]
    t = x.shape[1]
    scale = 1.0 / math.sqrt(self.config.head_dim)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    prefix = ((q @ keys[0].transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
    diagonal = [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]
    probs = torch.cat([prefix, *diagonal], dim=-1).softmax(-1)
    out = probs[..., :t] @ values[0]
    for j, value in enumerate(values[1:]):
        out = out + probs[..., t + j : t + j + 1] * value
    return self._out(out)


def loss_and_gradients(model, aux, ids, loss_mask, target, steps):
    model.zero_grad()
    batch = Batch(aux, ids, loss_mask, target, torch.ones_like(loss_mask), [])
    loss, _ = ttt_loss(ttt_forward(model, aux, ids, steps), batch, 0.8)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("chunk_scores", [attention_module.LSE_CHUNK_SCORES, 97])
def test_the_linear_memory_attention_equals_the_dense_one(model, monkeypatch, chunk_scores):
    """Loss and every gradient of 7 TTT steps equal the [T, T] implementation's in float32, with
    the causal log-sum-exp in one chunk or in many (97 scores: a few rows at a time)."""
    model = model.float().train()
    aux, ids = inputs(batch=2, length=48)
    aux = aux.float()
    loss_mask = torch.zeros(2, 48, dtype=torch.bool)
    loss_mask[0, 10:] = True
    loss_mask[1, 20:40] = True
    torch.manual_seed(3)
    target = torch.randn(2, 48, CONFIG.draft_vocab_size)
    monkeypatch.setattr(attention_module, "LSE_CHUNK_SCORES", chunk_scores)
    loss, grads = loss_and_gradients(model, aux, ids, loss_mask, target, 7)
    monkeypatch.setattr(Attention, "forward", dense_ttt_attention)
    dense_loss, dense_grads = loss_and_gradients(model, aux, ids, loss_mask, target, 7)
    torch.testing.assert_close(loss, dense_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == dense_grads.keys() and "fc.weight" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dense_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("chunk_scores", [1 << 24, 97, 1])
def test_the_causal_logsumexp_and_its_gradients_equal_the_dense_ones(monkeypatch, chunk_scores):
    """The chunked log-sum-exp's hand-written backward (no autograd through the chunks) against
    autograd through the dense masked [T, T] log-sum-exp, in float64: value, grad_q and grad_k."""
    torch.manual_seed(5)
    q = torch.randn(2, 3, 37, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 37, 8, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, 37, dtype=torch.float64)
    monkeypatch.setattr(attention_module, "LSE_CHUNK_SCORES", chunk_scores)
    lse = attention_module.causal_logsumexp(q, k, 0.3)
    grad_q, grad_k = torch.autograd.grad((lse * upstream).sum(), (q, k))
    causal = torch.ones(37, 37, dtype=torch.bool).tril()
    dense = ((q @ k.transpose(-1, -2)) * 0.3).masked_fill(~causal, float("-inf")).logsumexp(-1)
    dense_q, dense_k = torch.autograd.grad((dense * upstream).sum(), (q, k))
    torch.testing.assert_close(lse, dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_q, dense_q, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_k, dense_k, rtol=1e-10, atol=1e-12)


def saved_for_backward(run):
    """(what `run()` returns, the bytes autograd saved for backward while it ran)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return result, total


def test_no_score_block_is_kept_for_backward(model):
    """What autograd keeps for backward grows linearly in T: doubling T about doubles it (a kept
    [T, T] block would quadruple it)."""
    model = model.float().train()

    def saved(length: int) -> int:
        aux, ids = inputs(batch=1, length=length)
        return saved_for_backward(lambda: ttt_forward(model, aux.float(), ids, 7))[1]

    small, large = saved(256), saved(1024)
    assert large / small < 4.6, (small, large)  # 4x T: a [T, T] block would make it ~10x


def test_activation_checkpointing_changes_nothing_but_memory(model):
    """With the layer recomputed in backward: the same loss and gradients, less kept for it."""
    model = model.float().train()
    aux, ids = inputs(batch=2, length=64)
    aux = aux.float()
    loss_mask = torch.ones(2, 64, dtype=torch.bool)
    torch.manual_seed(4)
    target = torch.randn(2, 64, CONFIG.draft_vocab_size)

    def run(checkpointed: bool):
        model.checkpoint_layer = checkpointed
        (loss, grads), kept = saved_for_backward(
            lambda: loss_and_gradients(model, aux, ids, loss_mask, target, 7)
        )
        return loss, grads, kept

    loss, grads, kept = run(False)
    ckpt_loss, ckpt_grads, ckpt_kept = run(True)
    torch.testing.assert_close(ckpt_loss, loss, rtol=1e-6, atol=1e-7)
    assert ckpt_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert ckpt_kept < 0.7 * kept, (ckpt_kept, kept)


LONG_SAMPLE_STEP = """
import resource, sys, torch
torch.set_num_threads(2)
from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.eagle3.model import Eagle3Drafter, ttt_forward
from eaglenest.drafter.batches import Batch
from eaglenest.stages.train.loss import ttt_loss
T = int(sys.argv[1])
config = DrafterConfig(hidden_size=32, target_hidden_size=32, intermediate_size=64,
                       num_attention_heads=1, num_key_value_heads=1, head_dim=32, vocab_size=512,
                       draft_vocab_size=128, aux_layer_ids=(2, 4, 6), max_position_embeddings=T)
torch.manual_seed(0)
model = Eagle3Drafter(config).train()
aux, ids = torch.randn(1, T, 96), torch.randint(0, 512, (1, T))
mask = torch.ones(1, T, dtype=torch.bool)
before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
loss, _ = ttt_loss(ttt_forward(model, aux, ids, 3), Batch(aux, ids, mask, torch.randn(1, T, 128),
                   mask, []), 0.8)
loss.backward()
assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before)
"""
# bench/train.py --long-context at these sizes, 3 TTT steps, measured 456 MiB at T=4K and 806 MiB
# at 16K over the process's memory before the step; one [T, T] float32 block at 16K is 1 GiB, and
# the dense implementation kept several per step.
LONG_SAMPLE_BOUND_MIB = 1536


@pytest.mark.slow
def test_a_16k_token_sample_trains_within_a_memory_bound():
    """One TTT training step (forward, loss, backward) on a 16,384-token sample, on the CPU, in a
    fresh process: its peak memory over the step stays under the bound."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", LONG_SAMPLE_STEP, "16384"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    peak_mib = float(done.stdout.strip().splitlines()[-1])
    print(f"16K-token TTT step: {peak_mib:.0f} MiB over the process's memory before it")
    assert peak_mib < LONG_SAMPLE_BOUND_MIB


def assert_decoding_equals_ttt(model: Eagle3Drafter, own_tokens: bool = False) -> None:
    """Serving's chain at positions t (a cache of the verified context, then each draft step
    fed the data's next token, or with `own_tokens` the previous step's argmax) gives TTT's
    logits there."""
    aux, ids = inputs(batch=1, length=10)
    steps = 4
    with torch.no_grad():
        trained = ttt_forward(model, aux, ids, steps, own_tokens=own_tokens)
        for t in (0, 3, 5):
            cache = DecodeCache()
            positions = torch.arange(t + 1)[None]
            logits, hidden = model.step(
                ids[:, 1 : t + 2], model.project(aux[:, : t + 1]), positions, cache
            )
            torch.testing.assert_close(logits[0, -1], trained[0][0, t], rtol=1e-9, atol=1e-9)
            hidden = hidden[:, -1:]
            for i in range(1, steps):
                if own_tokens:
                    token = model.draft_to_target(logits[:, -1:].argmax(-1))
                else:
                    token = ids[:, t + 1 + i : t + 2 + i]
                logits, hidden = model.step(token, hidden, torch.tensor([[t + i]]), cache)
                torch.testing.assert_close(
                    logits[0, -1], trained[i][0, t], rtol=1e-9, atol=1e-9, msg=f"t={t} step={i}"
                )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decoding_with_a_cache_equals_training_time_test(variant):
    """What the drafter sees when serving is what TTT trains, for every EAGLE-3 variant."""
    assert_decoding_equals_ttt(make_model(replace(CONFIG, **VARIANTS[variant])))


def test_training_on_the_drafters_own_tokens_is_serving_its_own_drafts(model):
    assert_decoding_equals_ttt(model, own_tokens=True)
    aux, ids = inputs(batch=1, length=10)
    with torch.no_grad():
        own = ttt_forward(model, aux, ids, 3, own_tokens=True)
        data = ttt_forward(model, aux, ids, 3)
    torch.testing.assert_close(own[0], data[0], rtol=0, atol=0)  # step 0 reads the data
    assert not torch.allclose(own[1], data[1])  # later steps do not (the test can fail)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "plain"])
def test_each_variant_changes_what_the_drafter_computes(variant):
    """The same weights with the option on and off give other logits by step 1 at the latest
    (norm_output changes only what the next step gets): the option is wired in."""
    aux, ids = inputs(batch=1, length=8)
    plain = make_model(CONFIG)
    changed = make_model(replace(CONFIG, **VARIANTS[variant]))
    changed.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        a, b = ttt_forward(plain, aux, ids, 2), ttt_forward(changed, aux, ids, 2)
    assert not torch.allclose(a[1], b[1])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_variant_is_exported_as_vllm_reads_it(variant, tmp_path):
    """config.json has the four booleans where vLLM's llama_eagle3.py reads them, the tensors
    vLLM's names (input_norm, fc_norm.{i}), and loading the export gives the same drafter."""
    import json

    from safetensors import safe_open

    from eaglenest.drafter.eagle3.export import export_drafter, load_drafter

    model = make_model(replace(CONFIG, **VARIANTS[variant]))
    export_drafter(model, tmp_path, dtype="float32")
    config = json.loads((tmp_path / "config.json").read_text())
    options = VARIANTS[variant]
    for name in DRAFTER_VARIANTS:
        assert config[name] is options.get(name, False)
    assert config["eagle_config"]["norm_before_fc"] is options.get("norm_before_fc", False)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert ("input_norm.weight" in names) == options.get("norm_before_fc", False)
    assert ({"fc_norm.0.weight", "fc_norm.2.weight"} <= names) == options.get("fc_norm", False)
    loaded = load_drafter(tmp_path, model.embed_tokens.weight.float())
    aux, ids = inputs(batch=1, length=8)
    with torch.no_grad():
        expected = ttt_forward(model.float(), aux.float(), ids, 3)
        got = ttt_forward(loaded, aux.float(), ids, 3)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(e, g)


def test_the_loss_ignores_prompt_positions(model):
    model = model.float().train()
    aux, ids = inputs(batch=2, length=12)
    aux = aux.float()
    loss_mask = torch.zeros(2, 12, dtype=torch.bool)
    loss_mask[0, 5:] = True
    loss_mask[1, 7:11] = True
    torch.manual_seed(2)
    target = torch.randn(2, 12, CONFIG.draft_vocab_size)

    def loss_and_grads(target_logits):
        model.zero_grad()
        batch = Batch(aux, ids, loss_mask, target_logits, torch.ones_like(loss_mask), [])
        loss, stats = ttt_loss(ttt_forward(model, aux, ids, 3), batch, 0.8)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad], stats

    loss, grads, stats = loss_and_grads(target)
    changed = target.clone()
    changed[~loss_mask] = torch.randn(int((~loss_mask).sum()), CONFIG.draft_vocab_size) * 10
    loss2, grads2, _ = loss_and_grads(changed)
    assert torch.equal(loss, loss2)
    for g, g2 in zip(grads, grads2, strict=True):
        assert torch.equal(g, g2)
    # Step i counts the masked positions t + 1 + i inside the sequence.
    assert stats.counted == [int(shift_left(loss_mask, 1 + i, False).sum()) for i in range(3)]
    # A completion-position target does change it (the test can fail).
    changed[loss_mask] = torch.randn(int(loss_mask.sum()), CONFIG.draft_vocab_size) * 10
    assert not torch.equal(loss, loss_and_grads(changed)[0])


def test_positions_outside_the_draft_vocab_are_skipped_and_counted(model):
    aux, ids = inputs(batch=1, length=8)
    loss_mask = torch.ones(1, 8, dtype=torch.bool)
    in_vocab = torch.ones(1, 8, dtype=torch.bool)
    in_vocab[0, 3] = False
    target = torch.randn(1, 8, CONFIG.draft_vocab_size, dtype=torch.float64)
    batch = Batch(aux, ids, loss_mask, target, in_vocab, [])
    with torch.no_grad():
        _, stats = ttt_loss(ttt_forward(model, aux, ids, 2), batch, 0.8)
    # Step 0 predicts positions 1..7: 7 masked, one of them outside the vocab.
    assert stats.counted[0] == 6 and stats.skipped_outside_vocab == 1


def test_the_drafter_keeps_the_targets_hidden_size():
    from types import SimpleNamespace

    target = SimpleNamespace(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
    )
    config = DrafterConfig.from_target(target, draft_vocab_size=10, aux_layer_ids=(1, 2, 3))
    assert (config.hidden_size, config.target_hidden_size, config.head_dim) == (64, 64, 16)
    with pytest.raises(ValueError, match="shares the target's token embedding"):
        DrafterConfig.from_target(
            target, draft_vocab_size=10, aux_layer_ids=(1, 2, 3), overrides={"hidden_size": 32}
        )


def test_prefetch_yields_in_order_and_raises_the_loaders_error():
    from eaglenest.stages.train.feed import prefetch

    assert list(prefetch(iter(range(10)), depth=2)) == list(range(10))

    def broken():
        yield 1
        raise OSError("shard 00003 is truncated")

    items = prefetch(broken(), depth=2)
    assert next(items) == 1
    with pytest.raises(OSError, match="00003"):
        next(items)


def test_rotary_positions_shifted_by_a_constant_change_nothing(model):
    """Rotary attention sees only differences of positions: starting them at 1 (as one peer
    trainer does) instead of 0 trains and decodes the same drafter, so it is no recipe option."""
    aux, ids = inputs(batch=1, length=9)
    with torch.no_grad():
        hidden = model.project(aux)
        at_zero, _ = model.step(ids, hidden, torch.arange(9)[None], DecodeCache())
        at_one, _ = model.step(ids, hidden, torch.arange(9)[None] + 1, DecodeCache())
        spread, _ = model.step(ids, hidden, 2 * torch.arange(9)[None], DecodeCache())
    # The angles are float32 (as in transformers' Llama), hence the tolerance.
    torch.testing.assert_close(at_zero, at_one, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(at_zero, spread, rtol=1e-3, atol=1e-4)  # positions do matter


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("path", ["dense", "linear"])
def test_samples_packed_in_a_row_train_as_they_do_alone(model, checkpointed, path, monkeypatch):
    """Two samples of one row (`segments`) give, at every position with a target in its own
    sample, the logits and the gradients they give one to a row: attention stays within a sample
    and rotary positions restart. Both attention paths of packed rows: the dense masked block,
    and the linear-memory one (masked SDPA and log-sum-exp, here in chunks of a few queries)."""
    if path == "linear":
        monkeypatch.setattr(attention_module, "DENSE_PACKED_SCORES", 0)
        monkeypatch.setattr(attention_module, "LSE_CHUNK_SCORES", 64)
    model.checkpoint_layer = checkpointed
    steps, lengths = 3, (7, 5)
    aux, ids = inputs(batch=2, length=7)
    ids[1, 5:] = 0  # the second sample is 5 tokens; right padding as build_batch writes it
    packed_aux = torch.cat([aux[0], aux[1, :5]])[None]
    packed_ids = torch.cat([ids[0], ids[1, :5]])[None]
    segments = torch.tensor([[0] * 7 + [1] * 5])

    def kept(i: int) -> list[tuple[int, int, int]]:
        """(sample, position alone, position packed) of positions whose step-i target is in
        the same sample."""
        return [(s, t, t + 7 * s) for s, n in enumerate(lengths) for t in range(n - 1 - i)]

    weights = torch.randn(steps, 12, CONFIG.draft_vocab_size)

    def run(aux, ids, segments, packed):
        model.zero_grad()
        logits = ttt_forward(model, aux, ids, steps, segments=segments)
        rows = [
            torch.stack([logits[i][0 if packed else s, p if packed else t] for s, t, p in kept(i)])
            for i in range(steps)
        ]
        sum((r * weights[i, : len(r)]).sum() for i, r in enumerate(rows)).backward()
        return rows, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    alone, alone_grads = run(aux, ids, None, False)
    packed, packed_grads = run(packed_aux, packed_ids, segments, True)
    for a, b in zip(alone, packed, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for name, grad in alone_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5)


# --- the MLA drafter (train.drafter.attention: mla) -------------------------------------------

MLA_CONFIG = replace(
    CONFIG, attention="mla", head_dim=12, num_key_value_heads=4, q_lora_rank=16,
    kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
)  # fmt: skip


def test_mla_attention_equals_transformers_deepseek_v3_attention():
    """The MLA drafter's attention (step 0: causal) against transformers' DeepseekV3Attention,
    which matches DeepSeek's reference inference code, with the same weights: its input is an
    EAGLE-3 layer's 2H, hence transformers' hidden size 2H and our o_proj its first H rows."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    c = MLA_CONFIG
    ours = make_model(c).midlayer.self_attn
    reference = DeepseekV3Config(
        hidden_size=2 * c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,
        q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim, rope_interleave=True, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )  # fmt: skip
    reference._attn_implementation = "eager"
    theirs = DeepseekV3Attention(reference, layer_idx=0).double().eval()
    state = {k: v for k, v in ours.state_dict().items() if not k.startswith("o_proj")}
    theirs.load_state_dict({**state, "o_proj.weight": theirs.o_proj.weight}, strict=True)
    with torch.no_grad():
        theirs.o_proj.weight[: c.hidden_size] = ours.o_proj.weight
    torch.manual_seed(2)
    x = torch.randn(2, 9, 2 * c.hidden_size, dtype=torch.float64)
    positions = torch.arange(9).expand(2, 9)
    mask = torch.full((9, 9), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        cos_sin = DeepseekV3RotaryEmbedding(reference)(x, positions)
        expected, _ = theirs(x, cos_sin, mask.expand(2, 1, 9, 9))
        cos, sin = rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta, interleaved=True)
        got = ours(x, cos, sin, drafter_module.TTTStack())
    # Both compute the rotary angles in float32, hence the tolerance; another rotary layout or a
    # missing norm differs by the size of the values themselves.
    torch.testing.assert_close(got, expected[..., : c.hidden_size], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        cos, sin = rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta, interleaved=False)
        half_split = ours(x, cos, sin, drafter_module.TTTStack())
    assert not torch.allclose(half_split, expected[..., : c.hidden_size], rtol=1e-3, atol=1e-4)


def test_the_mla_drafter_trains_as_it_decodes_on_every_attention_path(monkeypatch):
    """TTT of the MLA drafter: decoding with a cache gives its logits, the linear-memory path its
    dense loss and gradients, and packed rows what each sample gives alone (the paths `Attention`
    shares, here with keys and values of other head sizes than the queries')."""
    model = make_model(MLA_CONFIG)
    assert_decoding_equals_ttt(model)
    model = model.float().train()
    aux, ids = inputs(batch=2, length=24)
    loss_mask = torch.ones(2, 24, dtype=torch.bool)
    target = torch.randn(2, 24, CONFIG.draft_vocab_size)
    monkeypatch.setattr(attention_module, "LSE_CHUNK_SCORES", 50)
    loss, grads = loss_and_gradients(model, aux.float(), ids, loss_mask, target, 4)
    monkeypatch.setattr(Attention, "forward", dense_ttt_attention)
    monkeypatch.setattr(drafter_module.MLAttention, "forward", dense_ttt_attention)
    dense_loss, dense_grads = loss_and_gradients(model, aux.float(), ids, loss_mask, target, 4)
    torch.testing.assert_close(loss, dense_loss, rtol=1e-5, atol=1e-6)
    assert "midlayer.self_attn.kv_b_proj.weight" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dense_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_mla_drafter_is_exported_as_vllms_deepseek_eagle3_loads_it(tmp_path):
    """config.json names Eagle3DeepseekV3ForCausalLM with the MLA sizes under a model type
    vLLM does not turn into its MTP drafter (deepseek_v3 would), the tensors carry DeepSeek's
    names, the export reloads as the same drafter, and norm_before_fc (which vLLM's MLA drafter
    lacks) is refused."""
    import json

    from safetensors import safe_open

    from eaglenest.drafter.eagle3.export import export_drafter, load_drafter
    from eaglenest.drafter.export_files import ExportError

    model = make_model(MLA_CONFIG).float()
    export_drafter(model, tmp_path, dtype="float32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
    assert config["model_type"] == "deepseek_v2"
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["v_head_dim"]) == (20, 4, 6)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    attention = {f"midlayer.self_attn.{n}.weight" for n in (
        "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
        "kv_b_proj", "o_proj")}  # fmt: skip
    assert attention <= names and not any("k_proj" in n or "v_proj" in n for n in names)
    loaded = load_drafter(tmp_path, model.embed_tokens.weight.detach())
    assert loaded.config == model.config
    aux, ids = inputs(batch=1, length=6)
    with torch.no_grad():
        torch.testing.assert_close(
            ttt_forward(loaded, aux.float(), ids, 2), ttt_forward(model, aux.float(), ids, 2)
        )
    with pytest.raises(ExportError, match="norm_before_fc"):
        export_drafter(make_model(replace(MLA_CONFIG, norm_before_fc=True)), tmp_path / "x")
