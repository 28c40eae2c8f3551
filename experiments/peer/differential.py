"""The two trainers on one batch: speculators 0.9.0's Eagle3DraftModel (built exactly as
experiments/peer/speculators_train.py builds it) and eaglenest's Eagle3Drafter with the same weights,
the same samples and the same objective (forward KL to the renormalised draft-vocabulary
distribution, decay 0.8, 7 TTT steps). Prints the losses (total and per TTT step), per step how
many positions' argmax agree, and per parameter the relative gradient difference.
Measured on demo256: losses equal to 5 digits, every argmax equal, gradients within 2e-7.

    PYTHONPATH=src /tmp/spec/venv/bin/python experiments/peer/differential.py --run-dir results/demo256
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import speculators_train as peer

from eaglenest.drafter.batches import (
    BatchPlan,
    TargetSignal,
    build_batch,
    open_shards,
)
from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.eagle3.model import Eagle3Drafter
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.formats.target_head import TargetHead
from eaglenest.stages.train.loss import Objective, ttt_loss


class Captured(Exception):
    def __init__(self, model):
        self.model = model


def peer_model(run_dir: Path, out: Path):
    """speculators' drafter as its cli builds it (seed, init, verifier weights), untrained."""

    class Capture:
        def __init__(self, model, *args, **kw):
            raise Captured(model)

    # speculators_train subclasses trainer_mod.Trainer inside main(): its trainer raises on init
    peer.trainer_mod.Trainer = Capture
    argv = sys.argv
    sys.argv = [argv[0], "--run-dir", str(run_dir), "--out", str(out), "--attn", "sdpa",
                "--norm-before-fc", "false", "--norm-output", "false", "--no-val"]  # fmt: skip
    try:
        peer.main()
    except Captured as c:
        return c.model
    finally:
        sys.argv = argv
    raise RuntimeError("speculators' cli did not build a trainer")


def ours_from(model, run_dir: Path) -> Eagle3Drafter:
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(str(run_dir / "target"))
    config = DrafterConfig.from_target(
        target,
        draft_vocab_size=model.config.draft_vocab_size,
        aux_layer_ids=tuple(model.config.eagle_aux_hidden_state_layer_ids),
        overrides={
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_before_residual": bool(model.config.norm_before_residual),
            "norm_output": False,
        },
    )
    ours = Eagle3Drafter(config)
    state = {k.replace("layers.0.", "midlayer."): v for k, v in model.state_dict().items()}
    state = {k: v for k, v in state.items() if not k.startswith("verifier_")}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    print("missing in ours:", missing, "unexpected:", unexpected)
    return ours


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("/tmp/spec/differential"))
    ap.add_argument("--samples", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--ttt-steps", type=int, default=7)
    a = ap.parse_args()

    model = peer_model(a.run_dir, a.out).float()
    print("peer trainable:", [n for n, p in model.named_parameters() if p.requires_grad])
    ours = ours_from(model, a.run_dir).float()
    print("ours trainable:", [n for n, p in ours.named_parameters() if p.requires_grad])

    shards_paths = sorted(
        p for p in (a.run_dir / "hidden").glob("*.safetensors") if p.stem.isdigit()
    )[:-1]
    head = TargetHead.load(a.run_dir / "hidden" / "target_head.safetensors")
    vocab = DraftVocab.load(a.run_dir / "vocab" / "draft_vocab.safetensors")
    shards = open_shards(shards_paths, head, vocab)
    plan = BatchPlan(shards, 1 << 20, 0)
    refs = [plan.refs[i] for i in a.samples]
    batch = TargetSignal(head, vocab).fill(build_batch(refs, shards))
    print("samples", [(r.shard, r.index, r.length) for r in refs])

    # speculators' packed batch of the same samples (its shift_batch, per document)
    parts = {k: [] for k in ("hidden_states", "input_ids", "verifier_last_hidden_states",
                             "loss_mask", "position_ids", "document_ids")}  # fmt: skip
    for row, ref in enumerate(refs):
        n = ref.length
        parts["hidden_states"].append(batch.aux[row, : n - 1])
        parts["input_ids"].append(batch.input_ids[row, 1:n])
        parts["verifier_last_hidden_states"].append(batch.final_hidden[row, 1:n])
        parts["loss_mask"].append(batch.loss_mask[row, 1:n])
        parts["position_ids"].append(torch.arange(1, n))
        parts["document_ids"].append(torch.full((n - 1,), row))
    packed = {k: torch.cat(v)[None] for k, v in parts.items()}

    from speculators.losses import resolve_loss_config

    model.train()
    draft_tokens, peer_loss, metrics = model(
        **packed,
        ttt_steps=a.ttt_steps,
        ttt_step_loss_decay=0.8,
        loss_config=resolve_loss_config("kl_div", "eager"),
    )
    peer_loss.backward()

    # Our logits, and our loss under the same objective
    ours.train()
    logits = ours(batch.aux, batch.input_ids, a.ttt_steps)
    loss, stats = ttt_loss(logits, batch, 0.8, objective=Objective("forward_kl", "renormalise"))
    loss.backward()

    print(f"loss: peer {float(peer_loss):.6f} ours {float(loss):.6f}")
    print("step losses peer:", [round(float(metrics[f"loss_{i}_sum"]) / 0.8**i, 5)
                                for i in range(a.ttt_steps)])  # fmt: skip
    print("step losses ours:", [round(x, 5) for x in stats.loss])
    print("counted ours:", stats.counted, "skipped outside vocab:", stats.skipped_outside_vocab)
    print("full acc peer:", [round(float(metrics[f"full_acc_{i}_sum"] / metrics[f"full_acc_{i}_total"]), 4) for i in range(a.ttt_steps)])  # fmt: skip
    print("acc ours:", [round(x, 4) for x in stats.accuracy])

    # Peer's draft tokens per step vs ours (argmax over the draft vocab) on each document
    offsets = [0]
    for ref in refs:
        offsets.append(offsets[-1] + ref.length - 1)
    for i in range(a.ttt_steps):
        agree, total = 0, 0
        for row, ref in enumerate(refs):
            p = draft_tokens[i][0, offsets[row] : offsets[row + 1]]
            o = logits[i][row, : ref.length - 1].argmax(-1)
            agree += int((p == o).sum())
            total += ref.length - 1
        print(f"step {i}: argmax agreement {agree}/{total}")

    peer_grads = {k.replace("layers.0.", "midlayer."): p.grad
                  for k, p in model.named_parameters() if p.grad is not None}  # fmt: skip
    for name, p in ours.named_parameters():
        if p.grad is None:
            continue
        g = peer_grads.get(name)
        if g is None:
            print(f"{name}: no peer gradient (|g| {p.grad.norm():.3e})")
            continue
        rel = (p.grad - g).norm() / g.norm().clamp_min(1e-30)
        print(f"{name}: |g| ours {p.grad.norm():.4e} peer {g.norm():.4e} rel diff {rel:.3e}")


if __name__ == "__main__":
    main()
