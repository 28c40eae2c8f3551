"""Training on the small demo run's real hidden states: overfitting, exact resumption after a
kill, a clear stop on a diverging loss, and the export vLLM and SGLang load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.workflow import SMALL_RUN
from transformers import AutoConfig

from eaglenest.common.config import settings_from_sections
from eaglenest.drafter.batches import (
    BatchPlan,
    TargetSignal,
    build_batch,
    build_packed_batch,
    open_shards,
)
from eaglenest.drafter.eagle3.export import export_drafter, load_drafter
from eaglenest.drafter.eagle3.model import ttt_forward
from eaglenest.drafter.export_files import ExportError
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.formats.target_head import TargetHead
from eaglenest.settings.train import TrainSettings
from eaglenest.stages.train.distributed import Processes
from eaglenest.stages.train.feed import step_batches
from eaglenest.stages.train.initialise import build_drafter
from eaglenest.stages.train.loss import ttt_loss
from eaglenest.stages.train.train import train_drafter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(finished_run: Path) -> dict[str, Path]:
    results = finished_run / "results" / SMALL_RUN
    return {
        "train": results / "hidden" / "00000.safetensors",
        "heldout": results / "hidden" / "00001.safetensors",
        "head": results / "hidden" / "target_head.safetensors",
        "vocab": results / "vocab" / "draft_vocab.safetensors",
        "target": results / "target",
        "drafter": results / "drafter",
    }


def arguments(run: dict[str, Path], tmp: Path) -> dict:
    return {
        "train_shards": [str(run["train"])],
        "eval_shards": [str(run["heldout"])],
        "target_head": str(run["head"]),
        "draft_vocab": str(run["vocab"]),
        "out_dir": str(tmp / "drafter"),
        "journal_dir": str(tmp / "journal"),
    }


def train_settings(run: dict[str, Path], **train) -> TrainSettings:
    """The `train` section with these values, on the run's target."""
    return settings_from_sections(TrainSettings, train=train, target={"path": str(run["target"])})


def test_overfits_a_handful_of_samples(run):
    torch.manual_seed(0)
    head, vocab = TargetHead.load(run["head"]), DraftVocab.load(run["vocab"])
    shards = open_shards([run["train"]], head, vocab)
    signal = TargetSignal(head, vocab)
    settings = settings_from_sections(TrainSettings, train={"ttt_steps": 2})
    model = build_drafter(AutoConfig.from_pretrained(run["target"]), head, vocab, settings)
    plan = BatchPlan(shards, max_batch_tokens=4096, seed=0, limit=6)
    refs = plan.epoch_order(0)[0]
    batch = signal.fill(build_batch(refs, shards))
    assert len(batch.samples) == 6
    # The token mask covers each sample's tokens (prompt and completion) and no padding.
    assert batch.token_mask.sum(1).tolist() == [r.length for r in refs]
    assert not (batch.loss_mask & ~batch.token_mask).any()
    assert (batch.token_mask & ~batch.loss_mask).any()  # the prompts
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(300):
        loss, stats = ttt_loss(ttt_forward(model, batch.aux, batch.input_ids, 2), batch, 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if stats.accuracy[0] >= 0.97:
            break
    assert stats.accuracy[0] >= 0.95, stats.accuracy


def test_init_std_draws_the_linear_weights_from_a_normal(run):
    head, vocab = TargetHead.load(run["head"]), DraftVocab.load(run["vocab"])
    target = AutoConfig.from_pretrained(run["target"])
    stds = {}
    for init_std in (None, 0.02):
        settings = settings_from_sections(TrainSettings, train={"init_std": init_std})
        model = build_drafter(target, head, vocab, settings)
        stds[init_std] = (model.fc.weight.std().item(), model.lm_head.weight)
    assert stds[0.02][0] == pytest.approx(0.02, rel=0.05)
    assert stds[None][0] == pytest.approx((1 / model.fc.in_features) ** 0.5 / 3**0.5, rel=0.05)
    # The LM head still starts from the target's rows (train.lm_head_init: target).
    assert torch.equal(stds[0.02][1], stds[None][1])


def test_batches_change_every_epoch_and_a_resumed_run_gets_the_same(run):
    """shuffle_pool > 0: each epoch new batches (the count may change), every sample once per
    epoch; from any step on, step_batches yields what an uninterrupted run would have."""
    head, vocab = TargetHead.load(run["head"]), DraftVocab.load(run["vocab"])
    shards = open_shards([run["train"]], head, vocab)
    fixed = BatchPlan(shards, 256, seed=0)
    assert {frozenset(map(id, b)) for b in fixed.epoch_order(0)} == {
        frozenset(map(id, b)) for b in fixed.epoch_order(1)
    }
    plan = BatchPlan(shards, 256, seed=0, shuffle_pool=1)
    epochs = [plan.epoch_order(e) for e in range(4)]
    assert plan.epoch_sizes(4) == [len(e) for e in epochs]
    for batches in epochs:
        assert sorted((r.shard, r.index) for b in batches for r in b) == sorted(
            (r.shard, r.index) for r in plan.refs
        )
    compositions = [{tuple((r.shard, r.index) for r in b) for b in e} for e in epochs]
    assert compositions[0] != compositions[1]
    steps = plan.epoch_sizes(4)
    total = sum(steps)
    whole = [(e, p, b.samples) for e, p, b in step_batches(plan, 0, total, steps, Processes())]
    assert [e for e, _, _ in whole] == [e for e, n in enumerate(steps) for _ in range(n)]
    for first in (1, steps[0] - 1, steps[0], steps[0] + steps[1] + 1):
        tail = step_batches(plan, first, total, steps, Processes())
        assert [(e, p, b.samples) for e, p, b in tail] == whole[first:]


def test_a_packed_batch_has_the_loss_and_gradients_of_the_same_samples_padded(run):
    """Real samples packed several to a row (`build_packed_batch`) give the loss, the counts and
    the gradients of the same samples one to a row."""
    head, vocab = TargetHead.load(run["head"]), DraftVocab.load(run["vocab"])
    shards = open_shards([run["train"]], head, vocab)
    signal = TargetSignal(head, vocab)
    settings = settings_from_sections(TrainSettings, train={"ttt_steps": 3})
    model = build_drafter(AutoConfig.from_pretrained(run["target"]), head, vocab, settings)
    refs = BatchPlan(shards, 1024, seed=0, packed=True).epoch_order(0)[0]
    padded = signal.fill(build_batch(refs, shards))
    packed = signal.fill(build_packed_batch(refs, shards, 1024))
    assert packed.input_ids.shape[0] < len(refs)  # several samples share rows
    assert packed.input_ids.numel() < padded.input_ids.numel()
    assert sorted(packed.samples) == sorted(padded.samples)

    def loss_and_grads(batch):
        model.zero_grad()
        logits = ttt_forward(model, batch.aux, batch.input_ids, 3, segments=batch.segments)
        loss, stats = ttt_loss(logits, batch, 0.8)
        loss.backward()
        return (
            loss,
            stats,
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )

    loss_a, stats_a, grads_a = loss_and_grads(padded)
    loss_b, stats_b, grads_b = loss_and_grads(packed)
    assert stats_b.counted == stats_a.counted and stats_b.correct == stats_a.correct
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-3, atol=1e-6)


def test_a_killed_run_resumes_exactly(run, tmp_path: Path):
    """N steps, SIGKILL, rerun: the same weights as one uninterrupted run, metrics without
    repeated steps."""
    settings = {
        "max_steps": 24,
        "epochs": 50,
        "lr": 1e-3,
        "warmup_steps": 4,
        "max_batch_tokens": 512,
        "packing": True,  # new packed batches every epoch, epochs of different lengths
        "ttt_steps": 2,
        "checkpoint_every": 8,
        "log_every": 1,
        "export_dtype": "float32",
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def spec(name: str) -> Path:
        path = tmp_path / f"{name}.json"
        path.write_text(
            json.dumps(
                {
                    "arguments": arguments(run, tmp_path / name),
                    "settings": json.loads(train_settings(run, **settings).to_json()),
                }
            )
        )
        return path

    command = [sys.executable, "-m", "eaglenest.stages.train.train"]
    straight = subprocess.run(
        [*command, str(spec("straight"))], env=env, capture_output=True, check=False
    )
    assert straight.returncode == 0, straight.stderr.decode()[-3000:]

    process = subprocess.Popen([*command, str(spec("killed"))], env=env, stderr=subprocess.PIPE)
    state = tmp_path / "killed" / "journal" / "state.pt"
    deadline = time.time() + 300
    while not state.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    killed_at = torch.load(state, weights_only=True)["step"]  # nothing but tensors and plain data
    assert 0 < killed_at < settings["max_steps"]
    assert not (tmp_path / "killed" / "drafter" / "model.safetensors").exists()

    resumed = subprocess.run(
        [*command, str(tmp_path / "killed.json")], env=env, capture_output=True, check=False
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]
    assert "resuming from" in resumed.stderr.decode()

    def weights(name: str) -> dict[str, torch.Tensor]:
        with safe_open(str(tmp_path / name / "drafter" / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    a, b = weights("straight"), weights("killed")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "killed" / "drafter" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["split"] == "train"
    ]
    assert steps == list(range(1, settings["max_steps"] + 1))


def test_a_shard_with_an_infinite_feature_stops_training_naming_shard_and_sample(
    run, tmp_path: Path
):
    """A shard with an infinite feature (a broken extraction) would make the loss NaN: it is
    refused when its sample is read, naming the shard, the sample and the tensor, before any
    step and with no checkpoint written (train.py's TrainingDiverged, naming the step and the
    batch, is what is left for a loss that turns NaN in training itself)."""
    from safetensors.torch import save_file

    with safe_open(str(run["train"]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        metadata = f.metadata()
    tensors["aux"][int(tensors["offsets"][3]) + 1, 0] = float("inf")  # sample 3
    broken = tmp_path / "broken" / "00000.safetensors"
    broken.parent.mkdir()
    save_file(tensors, str(broken), metadata=metadata)
    settings = train_settings(run, max_steps=40, max_batch_tokens=256, ttt_steps=2)
    with pytest.raises(ValueError, match=r"00000.safetensors: sample 3 \(.*\): aux holds NaN"):
        train_drafter(
            **{**arguments(run, tmp_path), "train_shards": [str(broken)]}, settings=settings
        )
    assert not (tmp_path / "drafter" / "model.safetensors").exists()


# Where each expected key and tensor name comes from (read in the loaders' source):
# - SGLang python/sglang/srt/models/llama_eagle3.py, LlamaForCausalLMEagle3 (EntryClass) and its
#   load_weights: unprefixed names are tried as `name` then `model.{name}`; q/k/v_proj and
#   gate/up_proj are stacked; `d2t` becomes hot_token_id = d2t + arange; `t2d` is skipped;
#   config keys hidden_size, target_hidden_size, num_attention_heads, num_key_value_heads,
#   head_dim, intermediate_size, rms_norm_eps, vocab_size, draft_vocab_size, tie_word_embeddings.
# - SGLang model_executor/model_runner.py: eagle_config["eagle_aux_hidden_state_layer_ids"],
#   captured as id + 1 (models/llama.py set_eagle3_layers_to_capture).
# - vLLM vllm/model_executor/models/llama_eagle3.py, Eagle3LlamaForCausalLM.load_weights: prefixes
#   `model.` to all but lm_head, renames midlayer. -> layers.0., d2t -> draft_id_to_target_id,
#   skips t2d; reads a top-level eagle_aux_hidden_state_layer_ids (spec_decode/eagle3 utils).
EXPECTED_CONFIG_KEYS = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "num_hidden_layers": 1,
    "tie_word_embeddings": False,
}
EXPECTED_TENSORS = [
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
]


def test_the_pipelines_export_has_the_layout_both_servers_load(run):
    config = json.loads((run["drafter"] / "config.json").read_text())
    for key, value in EXPECTED_CONFIG_KEYS.items():
        assert config[key] == value, key
    head = TargetHead.load(run["head"])
    h, th = config["hidden_size"], config["target_hidden_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    d, v, inter = config["draft_vocab_size"], config["vocab_size"], config["intermediate_size"]
    assert (th, v) == (head.hidden_size, head.vocab_size)
    assert config["eagle_aux_hidden_state_layer_ids"] == head.aux_layer_ids
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        i - 1 for i in head.aux_layer_ids
    ]
    shapes = {
        "fc.weight": [h, 3 * th],
        "midlayer.self_attn.q_proj.weight": [heads * hd, 2 * h],
        "midlayer.self_attn.k_proj.weight": [kv * hd, 2 * h],
        "midlayer.self_attn.v_proj.weight": [kv * hd, 2 * h],
        "midlayer.self_attn.o_proj.weight": [h, heads * hd],
        "midlayer.mlp.gate_proj.weight": [inter, h],
        "midlayer.mlp.down_proj.weight": [h, inter],
        "lm_head.weight": [d, h],
        "d2t": [d],
        "t2d": [v],
    }
    with safe_open(str(run["drafter"] / "model.safetensors"), "pt") as f:
        # The EAGLE-3 variants add their norms under vLLM's names (the demo uses all four).
        variant_tensors = ["input_norm.weight"] if config["norm_before_fc"] else []
        if config["fc_norm"]:
            variant_tensors += [f"fc_norm.{i}.weight" for i in range(len(head.aux_layer_ids))]
        assert sorted(f.keys()) == sorted(EXPECTED_TENSORS + variant_tensors)
        for name, shape in shapes.items():
            assert list(f.get_slice(name).get_shape()) == shape, name
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert bool(t2d[torch.arange(d) + d2t].all()) and int(t2d.sum()) == d


def test_reloading_the_export_reproduces_the_logits(run, tmp_path: Path):
    head, vocab = TargetHead.load(run["head"]), DraftVocab.load(run["vocab"])
    settings = settings_from_sections(TrainSettings)
    model = build_drafter(AutoConfig.from_pretrained(run["target"]), head, vocab, settings).eval()
    shards = open_shards([run["heldout"]], head, vocab)
    batch = build_batch(BatchPlan(shards, 2048, 0).epoch_order(0)[0], shards)
    export_drafter(model, tmp_path, dtype="float32")
    again = load_drafter(tmp_path, head.embed, expect_layer_ids=head.aux_layer_ids).eval()
    with torch.no_grad():
        for a, b in zip(
            ttt_forward(model, batch.aux, batch.input_ids, 3),
            ttt_forward(again, batch.aux, batch.input_ids, 3),
            strict=True,
        ):
            assert torch.equal(a, b)
    with pytest.raises(ExportError, match="eagle_aux_hidden_state_layer_ids"):
        load_drafter(tmp_path, head.embed, expect_layer_ids=[1, 2, 3])


RECIPE = {
    "max_steps": 6,
    "epochs": 50,
    "max_batch_tokens": 512,
    "ttt_steps": 3,
    "checkpoint_every": 3,
    "export_dtype": "float32",
    "lm_head_init": "target_frozen",
    "aux_noise": 0.05,
    "ttt_inputs": "drafter",
    "loss": "forward_kl",
    "target_outside_vocab": "ignore",
    "adam_betas": [0.9, 0.999],
    "drafter": {
        "norm_before_residual": True,
        "norm_output": True,
        "fc_norm": True,
        "norm_before_fc": False,
    },
}


def test_a_recipe_trains_exports_and_resumes_exactly(run, tmp_path: Path):
    """Every recipe option at once: the frozen LM head stays the target's rows of the draft
    tokens, the variant reaches config.json, and a run stopped after step 3 and resumed ends
    with the weights of a straight run (the aux noise is a function of seed and step)."""
    settings = train_settings(run, **RECIPE)
    assert settings.adam_betas == (0.9, 0.999)
    straight = train_drafter(**arguments(run, tmp_path / "straight"), settings=settings)
    assert straight["steps"] == 6
    stopped = train_drafter(
        **arguments(run, tmp_path / "resumed"), settings=settings, stop_after_step=3
    )
    assert stopped == {"stopped_at_step": 3}
    train_drafter(**arguments(run, tmp_path / "resumed"), settings=settings)

    def tensors(name: str) -> dict[str, torch.Tensor]:
        with safe_open(str(tmp_path / name / "drafter" / "model.safetensors"), "pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118

    a, b = tensors("straight"), tensors("resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    head, vocab = TargetHead.load(run["head"]), DraftVocab.load(run["vocab"])
    assert torch.equal(a["lm_head.weight"], head.lm_head[vocab.draft_ids].float())
    assert not torch.equal(a["norm.weight"], head.final_norm.float())  # trained from it
    config = json.loads((tmp_path / "straight" / "drafter" / "config.json").read_text())
    assert (config["norm_before_residual"], config["norm_output"], config["fc_norm"]) == (
        True, True, True,
    )  # fmt: skip
    assert config["norm_before_fc"] is False
    assert straight["settings"]["loss"] == "forward_kl"


def test_hidden_shards_with_other_layer_ids_are_refused(run, tmp_path: Path):
    from safetensors.torch import save_file

    with safe_open(str(run["head"]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        metadata = {**f.metadata(), "aux_layer_ids": "[1, 2, 3]"}
    other = tmp_path / "target_head.safetensors"
    save_file(tensors, str(other), metadata=metadata)
    with pytest.raises(ValueError, match=r"00000\.safetensors: field aux_layer_ids"):
        train_drafter(
            **{**arguments(run, tmp_path), "target_head": str(other)},
            settings=train_settings(run),
        )


def test_two_processes_under_torchrun_train_and_export(run, tmp_path: Path):
    """train.gpus > 1 runs DDP under torchrun; on CPU the processes talk over gloo."""
    from eaglenest.stages.train.train import run_under_torchrun

    section = {
        "gpus": 2,
        "max_steps": 4,
        "max_batch_tokens": 256,
        "ttt_steps": 2,
        "warmup_steps": 0,
        "log_every": 1,
        "export_dtype": "float32",
    }
    log = tmp_path / "torchrun.log"
    settings = train_settings(run, **section)
    run_under_torchrun(settings, arguments(run, tmp_path), str(log))
    report = json.loads((tmp_path / "drafter" / "train_report.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 4
    assert (tmp_path / "drafter" / "model.safetensors").exists()
    lines = (tmp_path / "drafter" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if '"train"' in line] == [1, 2, 3, 4]
