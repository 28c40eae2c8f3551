"""The peer of experiments/recipe.py's comparison: an EAGLE-3 drafter trained by vllm-project/speculators
0.9.0 on a run's hidden shards, saved as speculators saves it (vLLM loads it; decode it with
`experiments/recipe.py --external speculators=OUT/drafter`).

Runs speculators' own `speculators.train.cli.main(TrainConfig)` (model, Trainer, AdamW, cosine
schedule, TTT forward, loss, checkpoints) with these adapters patched in, nothing else:
  * data: `create_train_val_loaders` builds speculators' own dataloader (`_setup_dataloader`:
    its multipack sampler, collate and eagle3 `shift_batch`) over the run's shards (training:
    all but the last; the last, held out, only for its validation loss);
  * vocabulary: the run's exact d2t / t2d, through speculators' d2t_path / t2d_path;
  * `verifier_norm` is the identity: eaglenest's `final_hidden` is already the target's final
    normed state (speculators normally gets it before that norm);
  * device: the CPU (speculators puts the model on cuda:local_rank).
On the CPU flex attention has no backward: use `--attn sdpa` (same mask, same losses as eager).

Set-up (its own venv over make's .venv-vllm, whose torch and transformers it accepts):
    .venv-vllm/bin/python -m venv /tmp/spec && echo $PWD/.venv-vllm/lib/python3.11/site-packages \
        > /tmp/spec/lib/python3.11/site-packages/vllm.pth
    /tmp/spec/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 \
        multiprocess xxhash pandas pyarrow python-dateutil pytz tzdata six
    /tmp/spec/bin/python experiments/peer/speculators_train.py --run-dir results/demo256 --out /tmp/specA \
        --attn sdpa [--norm-before-fc false --norm-output false]
The drafter is OUT/checkpoints/<last epoch>, copied to OUT/drafter.
"""

import argparse
import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import logging

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
torch.set_num_interop_threads(1)

import speculators.train.trainer as trainer_mod
from speculators.train import cli
from speculators.train.config import TrainConfig
from speculators.train.data import BaseDataset
from speculators.train.dataloader import _setup_dataloader


class ShardDataset(BaseDataset):
    """eaglenest shards -> speculators sample dicts (pre-shift; shift_batch is applied
    by speculators' CollateFn exactly as for its own ArrowDataset)."""

    def __init__(self, shards, max_len, hidden_states_dtype):
        self.samples = []
        for p in shards:
            t = load_file(str(p))
            off = t["offsets"].tolist()
            for i in range(len(off) - 1):
                a, b = off[i], off[i + 1]
                self.samples.append(
                    {
                        "hidden_states": t["aux"][a:b].clone(),  # [T, 3*128] layers 2,4,5
                        "input_ids": t["input_ids"][a:b].clone().long(),
                        # final hidden AFTER the target's final norm
                        "verifier_last_hidden_states": t["final_hidden"][a:b].clone(),
                        "loss_mask": t["loss_mask"][a:b].clone().bool(),
                    }
                )
        super().__init__(max_len, hidden_states_dtype)

    def _compute_approx_lengths(self):
        return [int(s["input_ids"].shape[0]) for s in self.samples]

    def __len__(self):
        return len(self.samples)

    def _get_raw_data(self, index):
        return {k: v.clone() for k, v in self.samples[index].items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True, help="e.g. results/demo256")
    ap.add_argument("--out", required=True)
    ap.add_argument("--norm-before-fc", choices=["default", "true", "false"], default="default")
    ap.add_argument("--norm-output", choices=["default", "true", "false"], default="default")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--attn", default="simple_flex_attention")
    ap.add_argument("--hs-dtype", default="bfloat16")
    ap.add_argument("--no-val", action="store_true")
    ap.add_argument("--total-seq-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=42, help="speculators' default")
    a = ap.parse_args()

    save = Path(a.out)
    save.mkdir(parents=True, exist_ok=True)
    shards = sorted(p for p in (a.run_dir / "hidden").glob("*.safetensors") if p.stem.isdigit())
    train_shards, val_shards = shards[:-1], shards[-1:]
    with safe_open(shards[0], "pt") as f:
        layer_ids = json.loads(f.metadata()["aux_layer_ids"])
    # vocab mapping, exactly eaglenest's (draft id i -> target id i + d2t[i])
    v = load_file(str(a.run_dir / "vocab/draft_vocab.safetensors"))
    d2t = v["d2t"].numpy().astype(np.int64)
    t2d = v["t2d"].numpy().astype(bool)
    assert (np.flatnonzero(t2d) == np.arange(len(d2t)) + d2t).all()
    np.save(save / "d2t.npy", d2t)
    np.save(save / "t2d.npy", t2d)

    draft = {
        "num_layers": 1,
        "target_layer_ids": layer_ids,
        "d2t_path": str(save / "d2t.npy"),
        "t2d_path": str(save / "t2d.npy"),
        "draft_vocab_size": len(d2t),
        "draft_attn_impl": a.attn,
    }
    if a.norm_before_fc != "default":
        draft["norm_before_fc"] = a.norm_before_fc == "true"
    if a.norm_output != "default":
        draft["norm_output"] = a.norm_output == "true"
    cfg = TrainConfig(
        speculator_type="eagle3",
        seed=a.seed,
        verifier={"verifier_name_or_path": str(a.run_dir / "target")},
        draft=draft,
        data={
            "data_path": str(save / "unused_data"),
            "total_seq_len": a.total_seq_len,
            "hidden_states_dtype": a.hs_dtype,
            "num_workers": 0,
        },
        generation={"on_missing": "raise"},
        loss={
            "loss_fn": "kl_div",
            "loss_implementation": "eager",  # fused = triton GPU kernels
            "ttt_steps": 7,
            "ttt_step_loss_decay": 0.8,
        },
        optimizer={"optimizer": "adamw", "lr": 3e-3},
        scheduler={"scheduler_type": "cosine"},
        trainer={
            "epochs": a.epochs,
            "save_path": str(save / "checkpoints"),
            "max_steps": a.max_steps,
            "no_resume_from_checkpoint": True,
        },
        logging={"log_dir": str(save / "logs")},
    )
    cfg._backend_args = {"hidden_states_path": None}  # file backend; unused by our loaders
    print("RESOLVED CONFIG:", json.dumps(cfg.flatten(), default=str), flush=True)

    # ---- patches -------------------------------------------------------------
    hs_dtype = getattr(torch, a.hs_dtype)

    def my_loaders(**kw):
        tl = ShardDataset(train_shards, kw["total_seq_len"], hs_dtype)
        vl = ShardDataset(val_shards, kw["total_seq_len"], hs_dtype)
        print(
            f"train samples {len(tl)} tokens {sum(tl.approx_lengths)}; "
            f"val samples {len(vl)} tokens {sum(vl.approx_lengths)}",
            flush=True,
        )
        common = {
            "total_seq_len": kw["total_seq_len"],
            "hidden_size": kw["hidden_size"],
            "num_target_layers": kw["num_target_layers"],
            "num_workers": 0,
            "prefetch_factor": None,
            "preprocess": kw["preprocess"],
        }
        train_loader = _setup_dataloader(tl, seed=kw["seed"], **common)
        val_loader = None if a.no_val else _setup_dataloader(vl, **common)
        print(f"train batches/epoch {len(train_loader)}", flush=True)
        return train_loader, val_loader

    cli.create_train_val_loaders = my_loaders

    orig_build = cli.build_draft_model

    def build(*args, **kw):
        m = orig_build(*args, **kw)
        # final_hidden is already normed by the target's final RMSNorm:
        # targets must be lm_head(final_hidden) -> identity instead of verifier_norm.
        m.verifier_norm = torch.nn.Identity()
        print(m, flush=True)
        print("config:", m.config.to_json_string(), flush=True)
        return m

    cli.build_draft_model = build
    trainer_mod.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():  # _StepTimer syncs the accelerator
        torch.accelerator.synchronize = lambda *a, **k: None

    metrics_path = save / "metrics.jsonl"
    mf = open(metrics_path, "w")  # noqa: SIM115 (closed after training; the handler writes)

    class JsonlHandler(logging.Handler):
        def emit(self, record):
            if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
                mf.write(json.dumps(record.msg, default=float) + "\n")
                mf.flush()

    orig_setup_ml = cli.setup_metric_logger

    def setup_ml(*args, **kw):
        orig_setup_ml(*args, **kw)
        logging.getLogger("speculators.metrics").addHandler(JsonlHandler())

    cli.setup_metric_logger = setup_ml

    times = {"train_epoch_s": [], "val_epoch_s": []}

    class CPUTrainer(trainer_mod.Trainer):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.device_type = "cpu"
            print("optimizers:", self.optimizers, flush=True)
            print(
                "schedulers total/warmup:",
                trainer_mod._resolve_scheduler_steps(self.config, len(self.train_loader)),
                flush=True,
            )

        def train_epoch(self, epoch, **kw):
            t = time.perf_counter()
            r = super().train_epoch(epoch, **kw)
            times["train_epoch_s"].append(time.perf_counter() - t)
            print(f"EPOCH {epoch} train {times['train_epoch_s'][-1]:.1f}s", flush=True)
            return r

        def val_epoch(self, epoch):
            t = time.perf_counter()
            r = super().val_epoch(epoch)
            times["val_epoch_s"].append(time.perf_counter() - t)
            print(f"EPOCH {epoch} val {times['val_epoch_s'][-1]:.1f}s {r}", flush=True)
            return r

    cli.Trainer = CPUTrainer

    t0 = time.perf_counter()
    cli.main(cfg)
    total = time.perf_counter() - t0
    times["total_main_s"] = total
    times["train_total_s"] = sum(times["train_epoch_s"])
    times["train_s_per_epoch"] = times["train_total_s"] / max(1, len(times["train_epoch_s"]))
    (save / "times.json").write_text(json.dumps(times, indent=1))
    print("TIMES", json.dumps(times), flush=True)
    mf.close()
    checkpoints = save / "checkpoints"
    last = max((p for p in checkpoints.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    shutil.copytree(last, save / "drafter", dirs_exist_ok=True)
    exported = load_file(str(save / "drafter" / "model.safetensors"))
    assert np.array_equal(exported["d2t"].numpy(), d2t), "the saved d2t is not the run's"
    print(f"drafter: {save / 'drafter'} (from {last})", flush=True)


if __name__ == "__main__":
    main()
