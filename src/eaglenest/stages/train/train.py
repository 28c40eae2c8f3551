"""Training the EAGLE-3 drafter with training-time test (the `train` stage).

Loss of TTT step i (weight `step_weight`**i): cross-entropy of the drafter's distribution against
the target's distribution restricted to the draft vocabulary, at the loss-masked positions whose
target argmax is a draft token, divided by their count. Masked positions whose target argmax lies
outside the draft vocabulary are skipped and counted (`skipped_outside_vocab`).

Robustness: every `checkpoint_every` steps the journal (results/{run}/journal/train/, outside the
rule's outputs, so Snakemake never deletes it) gets the trainable weights, optimizer, scheduler,
step and RNG states; the batch order is a function of (seed, epoch), so the step number is the
data position. Rerunning the rule after a kill resumes exactly where the last checkpoint was. A
journal written for other inputs or settings (fingerprint) is set aside, not resumed.

Several GPUs: under torchrun (WORLD_SIZE > 1) the model is wrapped in DDP and rank r takes every
W-th batch of the epoch's order; one step = one batch per rank. Rank 0 writes everything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import pickle
import random
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from eaglenest.common.io import atomic_path, write_json
from eaglenest.drafter import DrafterConfig, Eagle3Drafter, shift_left, ttt_forward
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.formats.feature_batches import (
    Batch,
    BatchPlan,
    TargetSignal,
    build_batch,
    open_shards,
)
from eaglenest.formats.target_head import TargetHead

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
METRICS_FILE = "metrics.jsonl"


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step and the batch."""


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 10
    max_steps: int | None = None
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    max_batch_tokens: int = 16384
    ttt_steps: int = 7
    step_weight: float = 0.8
    checkpoint_every: int = 200
    log_every: int = 10
    eval_every: int = 0  # 0: held-out loss and accuracy at the end only
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"  # auto = bf16 autocast on CUDA, float32 on CPU
    export_dtype: str = "bfloat16"
    drafter: dict[str, Any] = field(default_factory=dict)  # overrides of the drafter's sizes

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> TrainSettings:
        return cls(**{k: section[k] for k in cls.__dataclass_fields__ if k in section})


# --- the objective ----------------------------------------------------------------------------


@dataclass
class StepStats:
    loss: list[float]
    correct: list[int]
    counted: list[int]
    skipped_outside_vocab: int

    @property
    def accuracy(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.correct, self.counted, strict=True)]


def ttt_loss(
    step_logits: list[torch.Tensor], batch: Batch, step_weight: float
) -> tuple[torch.Tensor, StepStats]:
    """Weighted TTT loss over the steps' logits [B, T, D], and per-step statistics."""
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    stats = StepStats([], [], [], 0)
    for i, logits in enumerate(step_logits):
        # Step i at position t predicts what the target predicts at position t + 1 + i.
        masked = shift_left(batch.loss_mask, 1 + i, False)
        valid = masked & shift_left(batch.in_draft_vocab, 1 + i, False)
        target = shift_left(batch.target_logits, 1 + i)
        n = int(valid.sum())
        # Zero the target off the valid positions before it meets the log-probs: a row of -inf
        # (top-k with no draft token) would put NaN into the gradient even behind a mask.
        p = torch.where(valid[..., None], target.float().softmax(-1), 0.0).nan_to_num(0.0)
        log_q = F.log_softmax(logits.float(), dim=-1)
        loss_i = -(p * log_q).sum() / max(n, 1)
        total = total + (step_weight**i) * loss_i
        with torch.no_grad():
            hits = (logits.argmax(-1) == target.argmax(-1)) & valid
        stats.loss.append(float(loss_i.detach()))
        stats.correct.append(int(hits.sum()))
        stats.counted.append(n)
        if i == 0:
            stats.skipped_outside_vocab = int((masked & ~valid).sum())
    return total, stats


# --- schedule, checkpoints, metrics ----------------------------------------------------------


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def rng_state() -> dict[str, Any]:
    """Every generator's state in types `torch.load(weights_only=True)` reads (tensors, numbers,
    strings, tuples, lists): a checkpoint is then loaded without unpickling arbitrary objects."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (name, keys.tolist(), pos, has_gauss, cached_gaussian),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def move_aside(path: Path) -> str:
    """Rename a journal file that will not be resumed to `<name>.stale`; return the new name. Every
    rank of a multi-GPU run reads the same file, so one of them may have moved it already."""
    stale = path.with_name(f"{path.name}.stale")
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, stale)
    return stale.name


def load_checkpoint(path: Path, device: str) -> dict[str, Any] | None:
    """The training state at `path`, read with `weights_only=True` (a journal on a shared disk is
    not trusted to run code); None when there is none. A file that cannot be read that way (an
    older format, a foreign or damaged file) is moved aside as `<name>.stale` with a warning, and
    training starts over: the journal only saves time, the outputs never depend on it."""
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location=device, weights_only=True)
    # Objects outside the allowed types and garbage bytes: UnpicklingError; a damaged zip:
    # RuntimeError; a truncated file: EOFError.
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        log.warning(
            "journal %s is not a readable training state (%s): moved to %s",
            path,
            str(err).splitlines()[0][:200],
            move_aside(path),
        )
        return None


def fingerprint(settings: TrainSettings, config: DrafterConfig, files: Iterable[Path]) -> str:
    """What a checkpoint is valid for: settings, drafter shape and the inputs' identity."""
    digest = hashlib.sha256()
    unchanging = {k: v for k, v in asdict(settings).items() if k not in ("log_every", "device")}
    digest.update(json.dumps([unchanging, config.to_dict()], sort_keys=True).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


class MetricsLog:
    """metrics.jsonl in the journal; on resume, lines past the checkpoint's step are dropped."""

    def __init__(self, path: Path, keep_until_step: int):
        self.path = path
        kept: list[str] = []
        if path.exists() and keep_until_step > 0:
            for line in path.read_text().splitlines():
                if line.strip() and json.loads(line)["step"] <= keep_until_step:
                    kept.append(line)
        path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as stream:
            stream.write(json.dumps(record, sort_keys=True) + "\n")


# --- devices and processes --------------------------------------------------------------------


@dataclass(frozen=True)
class Processes:
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_processes(device: str) -> Processes:
    """One process, or torchrun's group (NCCL on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if world_size == 1:
        return Processes(device=device)
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Processes(rank=rank, world_size=world_size, device=device)


def all_reduce_sum(values: list[float], processes: Processes) -> list[float]:
    if processes.world_size == 1:
        return values
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=processes.device)
    dist.all_reduce(tensor)
    return tensor.tolist()


# --- the loop ---------------------------------------------------------------------------------


def build_drafter(
    target_config: Any, head: TargetHead, vocab: DraftVocab, settings: TrainSettings
) -> Eagle3Drafter:
    config = DrafterConfig.from_target(
        target_config,
        draft_vocab_size=len(vocab.d2t),
        aux_layer_ids=tuple(head.aux_layer_ids),
        overrides=settings.drafter,
    )
    torch.manual_seed(settings.seed)
    model = Eagle3Drafter(config)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(head.embed)
    model.set_vocab(vocab.d2t, vocab.t2d)
    return model


@torch.no_grad()
def evaluate_heldout(
    model: Eagle3Drafter,
    plan: BatchPlan,
    signal: TargetSignal,
    settings: TrainSettings,
    processes: Processes,
) -> dict[str, Any]:
    """Loss and per-step accuracy on held-out shards (every batch, in a fixed order)."""
    model.eval()
    sums = [0.0] * (3 * settings.ttt_steps)
    for position, refs in enumerate(plan.epoch_order(0)):
        if position % processes.world_size != processes.rank:
            continue
        batch = signal.fill(build_batch(refs, plan.shards).to(processes.device))
        with autocast(processes.device, settings.precision):
            logits = ttt_forward(model, batch.aux, batch.input_ids, settings.ttt_steps)
        _, stats = ttt_loss(logits, batch, settings.step_weight)
        for i in range(settings.ttt_steps):
            sums[3 * i] += stats.loss[i] * stats.counted[i]
            sums[3 * i + 1] += stats.correct[i]
            sums[3 * i + 2] += stats.counted[i]
    sums = all_reduce_sum(sums, processes)
    model.train()
    counted = [sums[3 * i + 2] for i in range(settings.ttt_steps)]
    step_losses = [sums[3 * i] / max(counted[i], 1) for i in range(settings.ttt_steps)]
    return {
        # Weighted over the TTT steps like the training loss, so the two curves compare.
        "loss": sum(settings.step_weight**i * x for i, x in enumerate(step_losses)),
        "step_loss": step_losses,
        "acc": [sums[3 * i + 1] / max(counted[i], 1) for i in range(settings.ttt_steps)],
        "positions": int(counted[0]),
    }


def step_batches(
    plan: BatchPlan,
    first_step: int,
    total_steps: int,
    steps_per_epoch: int,
    processes: Processes,
) -> Iterator[tuple[int, int, Batch]]:
    """(epoch, position, batch) of this process for every step from first_step on. The order is
    a function of (seed, epoch): a resumed run gets the batches the killed one would have."""
    epoch_seen, order = -1, []
    for step in range(first_step, total_steps):
        epoch, position = divmod(step, steps_per_epoch)
        if epoch != epoch_seen:
            epoch_seen, order = epoch, plan.epoch_order(epoch)
        refs = order[position * processes.world_size + processes.rank]
        yield epoch, position, build_batch(refs, plan.shards)


def prefetch(items: Iterator, depth: int) -> Iterator:
    """Build the next `depth` items in a thread while the caller computes (reading shards
    overlaps with the drafter's forward and backward on the GPU)."""
    import queue
    import threading

    slots: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def fill() -> None:
        try:
            for item in items:
                slots.put(item)
        except Exception as error:  # noqa: BLE001 (re-raised in the caller's thread)
            slots.put(error)
        slots.put(done)

    threading.Thread(target=fill, daemon=True, name="prefetch").start()
    while (item := slots.get()) is not done:
        if isinstance(item, Exception):
            raise item
        yield item


def autocast(device: str, precision: str):
    bf16 = precision == "bf16" or (precision == "auto" and device.startswith("cuda"))
    return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=bf16)


def train_drafter(
    *,
    train_shards: list[str | Path],
    eval_shards: list[str | Path],
    target_head: str | Path,
    draft_vocab: str | Path,
    target_path: str | Path,
    out_dir: str | Path,
    journal_dir: str | Path,
    settings: TrainSettings,
    trust_remote_code: bool = False,
    stop_after_step: int | None = None,
) -> dict[str, Any]:
    """Train (or resume), export to out_dir, return the training report.

    `stop_after_step` ends the run early after that step's checkpoint (tests of resumption).
    """
    from tqdm import tqdm
    from transformers import AutoConfig

    from eaglenest.formats.drafter_export import export_drafter
    from eaglenest.target.files import resolve_target_dir

    processes = setup_processes(settings.device)
    out_dir, journal_dir = Path(out_dir), Path(journal_dir)
    journal_dir.mkdir(parents=True, exist_ok=True)
    head = TargetHead.load(target_head)
    vocab = DraftVocab.load(draft_vocab)
    shards = open_shards(train_shards, head, vocab)
    heldout = open_shards(eval_shards, head, vocab) if eval_shards else []
    signal = TargetSignal(head, vocab, processes.device)
    target_config = AutoConfig.from_pretrained(
        str(resolve_target_dir(target_path)), trust_remote_code=trust_remote_code
    )
    model = build_drafter(target_config, head, vocab, settings).to(processes.device)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        parameters, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    plan = BatchPlan(shards, settings.max_batch_tokens, settings.seed)
    eval_plan = BatchPlan(heldout, settings.max_batch_tokens, settings.seed) if heldout else None
    steps_per_epoch = len(plan) // processes.world_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"{len(plan)} batches cannot feed {processes.world_size} processes: "
            "lower train.max_batch_tokens or add shards"
        )
    total_steps = settings.epochs * steps_per_epoch
    if settings.max_steps:
        total_steps = min(total_steps, settings.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lr_lambda(total_steps, min(settings.warmup_steps, total_steps), settings.min_lr_ratio),
    )
    inputs = [Path(p) for p in [*train_shards, *eval_shards, target_head, draft_vocab]]
    print_ = fingerprint(settings, model.config, inputs)

    step = 0
    state_path = journal_dir / STATE_FILE
    state = load_checkpoint(state_path, processes.device)
    if state is not None:
        if state.get("fingerprint") == print_:
            model.load_state_dict(state["model"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"][min(processes.rank, len(state["rng"]) - 1)])
            step = state["step"]
            log.info("resuming from %s at step %d of %d", state_path, step, total_steps)
        else:
            log.warning(
                "journal %s was written for other inputs or settings: moved to %s",
                state_path,
                move_aside(state_path),
            )
    metrics = MetricsLog(journal_dir / METRICS_FILE, step) if processes.is_main else None

    ddp_model = model
    if processes.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [int(processes.device.split(":")[1])] if processes.device.startswith("cuda") else None
        ddp_model = DistributedDataParallel(model, device_ids=ids)

    def save_checkpoint() -> None:
        rngs = [rng_state()]
        if processes.world_size > 1:
            import torch.distributed as dist

            rngs = [None] * processes.world_size
            dist.all_gather_object(rngs, rng_state())
        if not processes.is_main:
            return
        state = {
            "fingerprint": print_,
            "step": step,
            "model": model.trainable_state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rngs,
        }
        with atomic_path(state_path) as tmp:
            torch.save(state, tmp)

    model.train()
    started = time.perf_counter()
    tokens_seen = 0
    loss_tokens = 0
    skipped = 0
    last = None
    progress = tqdm(
        total=total_steps,
        initial=step,
        desc="train drafter",
        file=sys.stderr,
        mininterval=2.0,
        disable=not processes.is_main,
    )
    data_wait = 0.0
    batches = step_batches(plan, step, total_steps, steps_per_epoch, processes)
    if processes.device.startswith("cuda"):
        # Overlap reading with the GPU's work. On CPU a loader thread competes with the training
        # threads for the same cores (measured: 0.73 of a bare loop, against 0.96 reading in
        # line, where reading takes ~1% of the time).
        batches = prefetch(batches, depth=2)
    while step < total_steps:
        waited = time.perf_counter()
        epoch, position, batch = next(batches)
        data_wait += time.perf_counter() - waited
        batch = signal.fill(batch.to(processes.device))
        with autocast(processes.device, settings.precision):
            logits = ttt_forward(ddp_model, batch.aux, batch.input_ids, settings.ttt_steps)
        loss, stats = ttt_loss(logits, batch, settings.step_weight)
        if not torch.isfinite(loss):
            raise TrainingDiverged(
                f"loss is {float(loss.detach())} at step {step} (epoch {epoch}, batch {position}); "
                f"samples (shard file, index): {batch.samples[:8]}"
                + (" ..." if len(batch.samples) > 8 else "")
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, settings.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += int(batch.loss_mask.numel())
        loss_tokens += stats.counted[0]
        skipped += stats.skipped_outside_vocab
        last = stats
        progress.update(1)
        progress.set_postfix(loss=f"{float(loss.detach()):.3f}", acc0=f"{stats.accuracy[0]:.2f}")
        if metrics and (step % settings.log_every == 0 or step == total_steps):
            elapsed = time.perf_counter() - started
            metrics.write(
                {
                    "split": "train",
                    "step": step,
                    "epoch": step / steps_per_epoch,
                    "lr": scheduler.get_last_lr()[0],
                    "loss": float(loss.detach()),
                    "acc": stats.accuracy,
                    "loss_tokens": loss_tokens,
                    "skipped_outside_vocab": skipped,
                    "tokens_per_s": tokens_seen * processes.world_size / max(elapsed, 1e-9),
                    "elapsed_s": elapsed,
                    "data_wait_share": data_wait / max(elapsed, 1e-9),
                }
            )
        if eval_plan and settings.eval_every and step % settings.eval_every == 0:
            result = evaluate_heldout(model, eval_plan, signal, settings, processes)
            if metrics:
                metrics.write({"split": "heldout", "step": step, **result})
        if step % settings.checkpoint_every == 0 or step == total_steps:
            save_checkpoint()
        if stop_after_step is not None and step >= stop_after_step:
            progress.close()
            save_checkpoint()
            return {"stopped_at_step": step}
    progress.close()
    wall = time.perf_counter() - started

    heldout_result = (
        evaluate_heldout(model, eval_plan, signal, settings, processes) if eval_plan else None
    )
    if not processes.is_main:
        return {}
    if heldout_result:
        metrics.write({"split": "heldout", "step": step, **heldout_result})
    export_drafter(model, out_dir, dtype=settings.export_dtype)
    (out_dir / METRICS_FILE).write_text((journal_dir / METRICS_FILE).read_text())
    report = {
        "steps": step,
        "epochs": step / steps_per_epoch,
        "ttt_steps": settings.ttt_steps,
        "train_tokens": tokens_seen * processes.world_size,
        "wall_s": wall,
        "tokens_per_s": tokens_seen * processes.world_size / max(wall, 1e-9),
        "train_acc": last.accuracy if last else [],
        "heldout_acc": heldout_result["acc"] if heldout_result else [],
        "heldout_loss": heldout_result["loss"] if heldout_result else None,
        "heldout_positions": heldout_result["positions"] if heldout_result else 0,
        "skipped_outside_vocab_share": skipped / max(skipped + loss_tokens, 1),
        "data_wait_share": data_wait / max(wall, 1e-9),
        "train_shards": [Path(p).stem for p in train_shards],
        "eval_shards": [Path(p).stem for p in eval_shards],
        "world_size": processes.world_size,
        "device": processes.device,
        "drafter": model.config.to_dict(),
        "settings": asdict(settings),
    }
    write_json(out_dir / "train_report.json", report)
    log.info(
        "trained %d steps in %.1f s (%.0f tokens/s); held-out accuracy per step: %s",
        step,
        wall,
        report["tokens_per_s"],
        [round(a, 3) for a in report["heldout_acc"]],
    )
    return report


# --- torchrun ---------------------------------------------------------------------------------


def run_under_torchrun(section: dict[str, Any], arguments: dict[str, Any], log_path: str) -> None:
    """Run train_drafter in `section["gpus"]` processes (DDP); their output goes to log_path."""
    import subprocess

    journal = Path(arguments["journal_dir"])
    journal.mkdir(parents=True, exist_ok=True)
    args_file = journal / "torchrun_args.json"
    args_file.write_text(json.dumps({"arguments": arguments, "settings": section}, default=str))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={section['gpus']}",
        "-m",
        "eaglenest.stages.train.train",
        str(args_file),
    ]
    log.info("running %s", " ".join(command))
    with open(log_path, "a") as stream:
        subprocess.run(command, check=True, stdout=stream, stderr=stream)


def main(argv: list[str] | None = None) -> None:
    """Entry point of one torchrun process: `python -m eaglenest.stages.train.train ARGS.json`."""
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    train_drafter(**spec["arguments"], settings=TrainSettings.from_config(spec["settings"]))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
