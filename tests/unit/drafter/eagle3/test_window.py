"""The drafter's sliding window (`train.drafter.sliding_window`) against a reference that masks by
rotary position, as vLLM's attention backends do when they decode the drafter: a query at position
p sees the keys at p - W < s <= p. In training-time test, step i's query at position t sits at
t + i, and the key of step j at t sits at t + j, so the window holds the step-0 keys of the last
W - i positions and the keys of steps j > i - W. Checked on every training path (the causal one in
one chunk or many, packed rows through the dense block or the linear-memory one, each TTT step),
with gradients, for windows of 1 to beyond T; then decoding with a cache against TTT, the export
vLLM reads, and the configs vLLM could not serve."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from support.drafter_sizes import CONFIG

import eaglenest.drafter.attention as attention_module
from eaglenest.common.config import ConfigError, validate_config
from eaglenest.drafter.attention import causal_logsumexp, training_attention
from eaglenest.drafter.eagle3.export import export_drafter, load_drafter
from eaglenest.drafter.eagle3.model import Eagle3Drafter, ttt_forward
from eaglenest.drafter.export_files import TrainedFor
from eaglenest.drafter.layers import DecodeCache
from eaglenest.settings.train import DrafterSettings

T, HEADS, DIM, STEPS = 13, 3, 8, 5
WINDOWS = [1, 2, 3, 6, T - 1, T, T + 5]


def reference_attention(q, keys, values, visible, scale, window):
    """Step len(keys) - 1 written out as one masked softmax over [step-0 keys, each earlier
    step's key at the query's own position], the mask taken from rotary positions."""
    step, t = len(keys) - 1, q.shape[2]
    query_at = torch.arange(t)[:, None] + step  # rotary position of each query
    seen0 = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
    if window is not None:
        seen0 &= torch.arange(t)[None, :] > query_at - window
    seen0 = seen0 if visible is None else seen0 & visible
    scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~seen0, float("-inf"))]
    for j, key in enumerate(keys[1:], start=1):
        own = (q * key).sum(-1, keepdim=True) * scale
        if window is not None and not j > step - window:  # the key at t + j left the window
            own = torch.full_like(own, float("-inf"))
        scores.append(own)
    weights = torch.cat(scores, -1).softmax(-1)
    out = weights[..., :t] @ values[0]
    for j, value in enumerate(values[1:]):
        out = out + weights[..., t + j : t + j + 1] * value
    return out


def packed_visible() -> torch.Tensor:
    """Row 0 one sample, row 1 two (8 + 5 tokens): causal within each sample."""
    segments = torch.tensor([[0] * T, [0] * 8 + [1] * (T - 8)])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]


PATHS = {
    # name: (packed, DENSE_PACKED_SCORES, LSE_CHUNK_SCORES)
    "causal": (False, attention_module.DENSE_PACKED_SCORES, attention_module.LSE_CHUNK_SCORES),
    "causal in chunks": (False, attention_module.DENSE_PACKED_SCORES, 150),
    "causal a row a chunk": (False, attention_module.DENSE_PACKED_SCORES, 1),
    "packed dense": (True, attention_module.DENSE_PACKED_SCORES, attention_module.LSE_CHUNK_SCORES),
    "packed linear": (True, 0, 150),
}


@pytest.mark.parametrize("window", [*WINDOWS, None])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_ttt_step_attends_as_a_reference_masked_by_the_window(path, window, monkeypatch):
    """Output and gradients (q, every step's keys and values) of steps 0..4 equal the reference's,
    in float64; a window of T or more equals full attention."""
    packed, dense_scores, chunk_scores = PATHS[path]
    monkeypatch.setattr(attention_module, "DENSE_PACKED_SCORES", dense_scores)
    monkeypatch.setattr(attention_module, "LSE_CHUNK_SCORES", chunk_scores)
    visible = packed_visible() if packed else None
    torch.manual_seed(7)
    shape = (2, HEADS, T, DIM)
    for step in range(STEPS):
        q = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        keys = [
            torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(step + 1)
        ]
        values = [torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in keys]
        upstream = torch.randn(shape, dtype=torch.float64)
        inputs = (q, *keys, *values)
        out = training_attention(q, keys, values, visible, 0.4, window)
        grads = torch.autograd.grad((out * upstream).sum(), inputs, materialize_grads=True)
        expected = reference_attention(q, keys, values, visible, 0.4, window)
        expected_grads = torch.autograd.grad(
            (expected * upstream).sum(), inputs, materialize_grads=True
        )
        msg = f"{path}, window {window}, step {step}"
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10, msg=msg)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=msg)
        if window is not None and window >= T + step:
            full = training_attention(q, keys, values, visible, 0.4, None)
            torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12, msg=msg)


@pytest.mark.parametrize("chunk_scores", [1 << 24, 97, 1])
@pytest.mark.parametrize("window", [1, 4, 36, 37, 50])
def test_the_windowed_logsumexp_and_its_gradients_equal_the_dense_ones(
    monkeypatch, chunk_scores, window
):
    """The autograd function's hand-written backward with a window, in one chunk or many: value,
    grad_q and grad_k against autograd through the dense masked log-sum-exp."""
    torch.manual_seed(5)
    q = torch.randn(2, 3, 37, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 37, 8, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, 37, dtype=torch.float64)
    monkeypatch.setattr(attention_module, "LSE_CHUNK_SCORES", chunk_scores)
    lse = causal_logsumexp(q, k, 0.3, window=window)
    grad_q, grad_k = torch.autograd.grad((lse * upstream).sum(), (q, k))
    index = torch.arange(37)
    band = (index[None] <= index[:, None]) & (index[None] > index[:, None] - window)
    dense = ((q @ k.transpose(-1, -2)) * 0.3).masked_fill(~band, float("-inf")).logsumexp(-1)
    dense_q, dense_k = torch.autograd.grad((dense * upstream).sum(), (q, k))
    torch.testing.assert_close(lse, dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_q, dense_q, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_k, dense_k, rtol=1e-10, atol=1e-12)


def make_model(window: int | None, **variant) -> Eagle3Drafter:
    torch.manual_seed(0)
    m = Eagle3Drafter(replace(CONFIG, sliding_window=window, **variant)).double()
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
    d2t = torch.arange(0, 2 * CONFIG.draft_vocab_size, 2) - torch.arange(CONFIG.draft_vocab_size)
    t2d = torch.zeros(CONFIG.vocab_size, dtype=torch.bool)
    t2d[torch.arange(0, 2 * CONFIG.draft_vocab_size, 2)] = True
    m.set_vocab(d2t, t2d)
    return m.eval()


def sample(length: int = 14):
    torch.manual_seed(1)
    aux = torch.randn(1, length, 3 * CONFIG.target_hidden_size, dtype=torch.float64)
    return aux, torch.randint(0, CONFIG.vocab_size, (1, length))


@pytest.mark.parametrize("window", [1, 2, 5, 9, 30])
def test_decoding_a_windowed_drafter_with_its_cache_equals_training_time_test(window):
    """The verified context fed to the cache in pieces (as rounds accept tokens) gives the logits
    of TTT step 0 at every position, and the draft chain from each position gives TTT step i's:
    decoding windows the chain's own keys as training does."""
    model = make_model(window)
    aux, ids = sample()
    steps = 4
    with torch.no_grad():
        trained = ttt_forward(model, aux, ids, steps)
        cache, pieces = DecodeCache(), [(0, 3), (3, 4), (4, 9), (9, 10)]
        for first, last in pieces:
            logits, _ = model.step(
                ids[:, first + 1 : last + 1], model.project(aux[:, first:last]),
                torch.arange(first, last)[None], cache,
            )  # fmt: skip
            torch.testing.assert_close(logits[0], trained[0][0, first:last], rtol=1e-9, atol=1e-9)
        for t in (2, 6, 9):
            cache = DecodeCache()
            logits, hidden = model.step(
                ids[:, 1 : t + 2], model.project(aux[:, : t + 1]), torch.arange(t + 1)[None], cache
            )
            hidden = hidden[:, -1:]
            for i in range(1, steps):
                token = ids[:, t + 1 + i : t + 2 + i]
                logits, hidden = model.step(token, hidden, torch.tensor([[t + i]]), cache)
                torch.testing.assert_close(
                    logits[0, -1], trained[i][0, t], rtol=1e-9, atol=1e-9, msg=f"t={t} step={i}"
                )


def test_a_window_changes_the_drafter_only_where_it_cuts():
    """A window of the sample's length or more is full attention; a shorter one changes the
    logits of the positions (and steps) whose keys it drops, and no others."""
    aux, ids = sample()
    with torch.no_grad():
        full = ttt_forward(make_model(None), aux, ids, 3)
        wide = ttt_forward(make_model(14 + 3), aux, ids, 3)
        short = ttt_forward(make_model(4), aux, ids, 3)
    for i in range(3):
        torch.testing.assert_close(wide[i], full[i], rtol=1e-12, atol=1e-12)
        # Step i at t: the window reaches back to t + i - 3 >= 0 up to t = 3 - i.
        torch.testing.assert_close(short[i][0, : 4 - i], full[i][0, : 4 - i], rtol=1e-9, atol=1e-9)
        assert not torch.allclose(short[i][0, 4 - i :], full[i][0, 4 - i :], rtol=1e-4, atol=1e-4)


def test_the_window_is_exported_as_vllms_llama_eagle3_reads_it(tmp_path):
    """config.json names the layer sliding (layer_types, indexed past the target's layers) and
    gives the window; the export loads back with it; full attention writes neither key."""
    model = make_model(16).float()
    export_drafter(model, tmp_path / "windowed", "float32")
    config = json.loads((tmp_path / "windowed" / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] and config["sliding_window"] == 16
    loaded = load_drafter(tmp_path / "windowed", model.embed_tokens.weight)
    assert loaded.config.sliding_window == 16
    export_drafter(make_model(None).float(), tmp_path / "full", "float32")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert "layer_types" not in config and "sliding_window" not in config


def test_the_export_records_what_the_drafter_was_trained_with(tmp_path):
    """config.json's `eaglenest` record (what the served check compares with vLLM's reading):
    the positions trained and served, the rotary base unscaled, the window of its one layer."""
    trained = TrainedFor(trained_positions=900, served_length=4096)
    export_drafter(make_model(16).float(), tmp_path / "windowed", "float32", trained=trained)
    record = json.loads((tmp_path / "windowed" / "config.json").read_text())["eaglenest"]
    assert record["trained_positions"] == 900 and record["served_length"] == 4096
    assert record["rope"] == {"rope_theta": CONFIG.rope_theta, "rope_scaling": None}
    assert record["sliding_window"] == [16]
    export_drafter(make_model(None).float(), tmp_path / "full", "float32")
    record = json.loads((tmp_path / "full" / "config.json").read_text())["eaglenest"]
    assert record["sliding_window"] == [None] and record["trained_positions"] is None


def test_a_window_vllm_cannot_serve_is_refused_naming_the_key():
    """The MLA drafter (vLLM builds its attention without a window) and a list that is not one
    entry per decoder layer fail at config validation and where training reads its settings
    (one refusal: settings.train.drafter_window); N, [N] and [null] validate."""
    mla = {"attention": "mla", "norm_before_fc": False, "sliding_window": 512}
    bad = [mla, {"sliding_window": [512, 512]}, {"sliding_window": 0}]
    for drafter in bad:
        with pytest.raises(ConfigError, match=r"train\.drafter\.sliding_window"):
            validate_config({"train": {"drafter": drafter}})
    for value in (512, [512], [None], None):
        no_sink = {"sink": 0}  # a sink beside a window is refused (below)
        validate_config({"train": {"drafter": {"sliding_window": value}, "sequence": no_sink}})
    # A sink's tokens at positions far behind the window would be near by index.
    for sequence in ({}, {"sink": 4}):
        with pytest.raises(ConfigError, match=r"sliding_window 512 with train\.sequence\.sink"):
            validate_config({"train": {"drafter": {"sliding_window": 512}, "sequence": sequence}})
    for mode in ("head", "whole"):
        validate_config({"train": {"drafter": {"sliding_window": 512}, "sequence": {"mode": mode}}})
    with pytest.raises(ValueError, match=r"train\.drafter\.sliding_window"):
        DrafterSettings.from_config({"train": {"drafter": mla}})


def saved_bytes(model: Eagle3Drafter, length: int) -> int:
    """The bytes autograd keeps for backward over 7 TTT steps on one sample."""
    aux, ids = sample(length)
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt_forward(model.float().train(), aux.float(), ids, 7)
    return total


def test_a_window_keeps_no_more_for_backward_than_full_attention():
    """What autograd keeps grows linearly in T with a window as without, and never more."""
    for length in (256, 1024):
        windowed, full = saved_bytes(make_model(64), length), saved_bytes(make_model(None), length)
        assert windowed <= full, (length, windowed, full)
    assert saved_bytes(make_model(64), 1024) / saved_bytes(make_model(64), 256) < 4.6
