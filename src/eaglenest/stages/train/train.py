"""Training a drafter (the `train` stage): the loop, one for every family of train.families.

What a family is (its model, its loss on a batch, its export) is families.py's table; the
per-position objective is in loss.py, the processes and devices in distributed.py, the drafter's
initial weights and the schedule in initialise.py, the batches of every step in feed.py.

Robustness: a journal of checkpoints and metrics outside the rule's outputs lets a rerun after a
kill resume exactly where the last checkpoint was (checkpoint.py).

States: from hidden-state files, or (hidden.store none/budget) asked of the capture servers
ahead of the steps that read them (capture/reader.py), packed as the files
would hold them; `data_wait_share` is the share of the time the loop waited for them.

Several GPUs, on one node or several (train.gpus, train.nodes): under torchrun (WORLD_SIZE > 1) the model is wrapped in DDP and rank r takes every
W-th batch of the epoch's order; one step = one batch per rank. The step's loss is the mean over
the positions of all ranks' batches, however unequal (`ttt_loss`), and the logged loss and
accuracy are those of all ranks (`global_step`). Rank 0 writes everything.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eaglenest.capture.reader import PooledStates, ask_ahead, open_pooled_shards
from eaglenest.common.io import write_json
from eaglenest.common.threads import job_threads, use_threads
from eaglenest.drafter.batches import (
    BatchPlan,
    TargetSignal,
    open_shards,
)
from eaglenest.drafter.export_files import TrainedFor
from eaglenest.formats.draft_vocab import DraftVocab
from eaglenest.formats.target_head import TargetHead
from eaglenest.formats.train_report import TrainReport
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.train import FamilySettings, TrainSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.train.checkpoint import (
    METRICS_FILE,
    STATE_FILE,
    MetricsLog,
    fingerprint,
    resume,
    save_checkpoint,
)
from eaglenest.stages.train.distributed import (
    Processes,
    autocast,
    data_parallel,
    leave_processes,
    run_under_torchrun,  # noqa: F401 (scripts and tests reach the launch through this module)
    setup_processes,
)
from eaglenest.stages.train.families import Recipe, build_recipe
from eaglenest.stages.train.feed import (
    SequenceTally,
    prefetch,
    step_batches,
    step_refs,
    with_aux_noise,
)
from eaglenest.stages.train.heldout import evaluate_heldout
from eaglenest.stages.train.initialise import lr_lambda
from eaglenest.stages.train.loss import Objective, StepStats, global_step

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step and the batch."""


@dataclass
class Training:
    """What a run trains with, built by `set_up_training` as for step 0 (`resume` may then load
    a checkpoint into the model, optimizer and scheduler)."""

    settings: TrainSettings
    processes: Processes
    recipe: Recipe  # the family: its drafter, loss and export
    parameters: list[torch.nn.Parameter]  # the trainable ones
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    signal: TargetSignal
    plan: BatchPlan
    eval_plan: BatchPlan | None
    epoch_steps: list[int]  # steps of each epoch (per process)
    total_steps: int
    fingerprint: str  # the settings and inputs a checkpoint must have been written for
    journal_dir: Path
    states: PooledStates | None = None  # hidden.store none/budget: the capture servers' states
    tally: SequenceTally = field(default_factory=SequenceTally)  # what this process's batches held

    @property
    def model(self) -> torch.nn.Module:
        return self.recipe.model

    @property
    def state_path(self) -> Path:
        return self.journal_dir / STATE_FILE

    def epochs_at(self, step: int) -> float:
        """Epochs done after `step` steps, the current one's fraction included."""
        for epoch, steps in enumerate(self.epoch_steps):
            if step < steps:
                return epoch + step / steps
            step -= steps
        return float(len(self.epoch_steps))


@dataclass
class Progress:
    """Where the loop stands; the counters cover this process since it (re)started."""

    step: int
    started: float  # time.perf_counter() when the loop began
    tokens_seen: int = 0
    loss_tokens: int = 0
    skipped_outside_vocab: int = 0
    data_wait_s: float = 0.0
    last: StepStats | None = None  # of the latest step


def open_data(files: list, tokens: list, states: PooledStates | None, head, vocab) -> list:
    """Hidden-state files, then tokens shards whose states the capture servers give."""
    return [*open_shards(files, head, vocab), *open_pooled_shards(states, tokens, head, vocab)]


def batch_plans(
    shards: list, heldout: list, settings: TrainSettings, layers: tuple[int, ...]
) -> tuple[BatchPlan, BatchPlan | None]:
    """The training batches and the held-out ones, of the captured layers the family's drafter
    reads (`layers`: its config's, the recipe's `family_head`)."""
    plan = BatchPlan(
        shards,
        settings.max_batch_tokens,
        settings.seed,
        shuffle_pool=settings.shuffle_pool,
        packed=settings.packing,
        aux_layer_ids=layers,
        sequence=settings.sequence,
    )
    if not heldout:
        return plan, None
    # Held out: whole samples, the same yardstick whatever train.sequence trains on.
    return plan, BatchPlan(heldout, settings.max_batch_tokens, settings.seed, aux_layer_ids=layers)


def set_up_training(
    *,
    train_shards: list[str | Path],
    eval_shards: list[str | Path],
    target_head: str | Path,
    draft_vocab: str | Path,
    journal_dir: str | Path,
    settings: TrainSettings,
    family: FamilySettings | None = None,
    pooled_train: list[str | Path] = (),
    pooled_eval: list[str | Path] = (),
    hidden: HiddenSettings | None = None,
    runtime: VllmRuntime | None = None,
) -> Training:
    """Processes, data, drafter (seeded; of `family`, EAGLE-3 by default), optimizer and
    schedule of a run. `pooled_*`: tokens shards whose states the capture servers give
    (train_drafter), after the files' shards."""
    processes = setup_processes(settings.device)
    journal_dir = Path(journal_dir)
    journal_dir.mkdir(parents=True, exist_ok=True)
    head = TargetHead.load(target_head)
    vocab = DraftVocab.load(draft_vocab)
    pooled = [*pooled_train, *pooled_eval]
    states = PooledStates.of_job(hidden, runtime, journal_dir, pooled, settings.max_batch_tokens)
    shards = open_data(train_shards, pooled_train, states, head, vocab)
    heldout = open_data(eval_shards, pooled_eval, states, head, vocab)
    signal = TargetSignal(head, vocab, processes.device)
    recipe = build_recipe(head, vocab, settings, family or FamilySettings.eagle3())
    settings.sequence.check_window(getattr(recipe.model.config, "sliding_window", None))
    model = recipe.model.to(processes.device)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        parameters,
        lr=settings.lr,
        betas=tuple(settings.adam_betas),
        weight_decay=settings.weight_decay,
    )
    plan, eval_plan = batch_plans(shards, heldout, settings, recipe.model.config.aux_layer_ids)
    epoch_sizes = plan.epoch_sizes(settings.epochs)
    epoch_steps = [n // processes.world_size for n in epoch_sizes]
    if min(epoch_steps) == 0:
        raise ValueError(
            f"{min(epoch_sizes)} batches cannot feed {processes.world_size} processes: "
            "lower train.max_batch_tokens or add shards"
        )
    total_steps = sum(epoch_steps)
    if settings.max_steps:
        total_steps = min(total_steps, settings.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lr_lambda(total_steps, min(settings.warmup_steps, total_steps), settings.min_lr_ratio),
    )
    inputs = [Path(p) for p in [*train_shards, *eval_shards, *pooled, target_head, draft_vocab]]
    return Training(
        settings=settings,
        processes=processes,
        recipe=recipe,
        parameters=parameters,
        optimizer=optimizer,
        scheduler=scheduler,
        signal=signal,
        plan=plan,
        eval_plan=eval_plan,
        epoch_steps=epoch_steps,
        total_steps=total_steps,
        fingerprint=fingerprint(
            settings, recipe.description(), inputs, states.identity if states else ""
        ),
        journal_dir=journal_dir,
        states=states,
    )


def train_step(
    training: Training, model: torch.nn.Module, batches: Iterator, progress: Progress
) -> float:
    """One optimizer step on the next batch (`model`: the drafter or its DDP wrapper); advances
    `progress` and returns the loss."""
    settings, device = training.settings, training.processes.device
    waited = time.perf_counter()
    epoch, position, batch = next(batches)
    progress.data_wait_s += time.perf_counter() - waited
    training.tally.add(batch)
    batch = training.signal.fill(batch.to(device))
    batch = with_aux_noise(batch, settings.aux_noise, settings.seed, progress.step)
    with autocast(device, settings.precision):
        loss, stats = training.recipe.loss(
            model, batch, Objective.of(settings), training.processes, progress.step
        )
    # Over all processes, so that a NaN on one rank stops every rank at the same step.
    value, stats = global_step(loss, stats, training.processes)
    if not math.isfinite(value):
        raise TrainingDiverged(
            f"loss is {value} at step {progress.step} (epoch {epoch}, "
            f"batch {position}); samples (shard file, index): {batch.samples[:8]}"
            + (" ..." if len(batch.samples) > 8 else "")
        )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(training.parameters, settings.grad_clip)
    training.optimizer.step()
    training.scheduler.step()
    training.optimizer.zero_grad(set_to_none=True)
    progress.step += 1
    progress.tokens_seen += int(batch.loss_mask.numel())
    progress.loss_tokens += stats.counted[0]
    progress.skipped_outside_vocab += stats.skipped_outside_vocab
    progress.last = stats
    return value


def log_step(
    training: Training, progress: Progress, loss: float, metrics: MetricsLog | None
) -> None:
    """After a step: its line in metrics.jsonl every `log_every` steps and at the last one, and
    the held-out evaluation every `eval_every` steps (every process takes part in that)."""
    settings, step = training.settings, progress.step
    if metrics and (step % settings.log_every == 0 or step == training.total_steps):
        elapsed = time.perf_counter() - progress.started
        tokens = progress.tokens_seen * training.processes.world_size
        metrics.write(
            {
                "split": "train",
                "step": step,
                "epoch": training.epochs_at(step),
                "lr": training.scheduler.get_last_lr()[0],
                "loss": loss,
                "acc": progress.last.accuracy,
                "loss_tokens": progress.loss_tokens,
                "skipped_outside_vocab": progress.skipped_outside_vocab,
                "tokens_per_s": tokens / max(elapsed, 1e-9),
                "elapsed_s": elapsed,
                "data_wait_share": progress.data_wait_s / max(elapsed, 1e-9),
            }
        )
    if training.eval_plan and settings.eval_every and step % settings.eval_every == 0:
        result = evaluate_heldout(
            training.recipe, training.eval_plan, training.signal, settings, training.processes
        )
        if metrics:
            metrics.write({"split": "heldout", "step": step, **result})


def finish(
    training: Training,
    progress: Progress,
    metrics: MetricsLog | None,
    out_dir: Path,
    shard_names: dict[str, list[str]],
) -> dict[str, Any]:
    """The final held-out evaluation (every process), then on rank 0 the export, metrics.jsonl
    and train_report.json in out_dir; returns the report ({} on the other ranks)."""
    settings, processes, step = training.settings, training.processes, progress.step
    wall = time.perf_counter() - progress.started
    heldout = (
        evaluate_heldout(training.recipe, training.eval_plan, training.signal, settings, processes)
        if training.eval_plan
        else None
    )
    tally = training.tally.over(processes)
    if not processes.is_main:
        return {}
    if heldout:
        metrics.write({"split": "heldout", "step": step, **heldout})
    # The positions trained (the largest a batch held, + 1, over every process; checkpointed,
    # so a resumed run counts what the killed one trained): the served check compares them.
    positions = tally.max_position + 1
    training.recipe.export(out_dir, TrainedFor(positions, training.recipe.served_length))
    (out_dir / METRICS_FILE).write_text((training.journal_dir / METRICS_FILE).read_text())
    train_tokens = progress.tokens_seen * processes.world_size
    skipped, loss_tokens = progress.skipped_outside_vocab, progress.loss_tokens
    report = TrainReport(
        steps=step,
        epochs=training.epochs_at(step),
        family=training.recipe.name,
        ttt_steps=len(training.recipe.slot_weights),
        train_tokens=train_tokens,
        wall_s=wall,
        tokens_per_s=train_tokens / max(wall, 1e-9),
        train_acc=progress.last.accuracy if progress.last else [],
        heldout_acc=heldout["acc"] if heldout else [],
        heldout_loss=heldout["loss"] if heldout else None,
        heldout_positions=heldout["positions"] if heldout else 0,
        skipped_outside_vocab_share=skipped / max(skipped + loss_tokens, 1),
        data_wait_share=progress.data_wait_s / max(wall, 1e-9),
        train_shards=shard_names["train_shards"],
        eval_shards=shard_names["eval_shards"],
        sequence={
            "mode": settings.sequence.mode,
            "length": settings.sequence.length,
            "sink": settings.sequence.sink,
            "tokens_trained": tally.tokens,
        },
        max_position_trained=tally.max_position,
        world_size=processes.world_size,
        device=processes.device,
        drafter=training.recipe.description(),
        settings=settings.recorded(),
    )
    write_json(out_dir / "train_report.json", report.to_json())
    log.info(
        "trained %d steps in %.1f s (%.0f tokens/s); held-out accuracy per step: %s",
        step,
        wall,
        report.tokens_per_s,
        [round(a, 3) for a in report.heldout_acc],
    )
    return report.to_json()


def train_drafter(
    *,
    train_shards: list[str | Path],
    eval_shards: list[str | Path],
    target_head: str | Path,
    draft_vocab: str | Path,
    out_dir: str | Path,
    journal_dir: str | Path,
    settings: TrainSettings,
    family: FamilySettings | str | None = None,
    stop_after_step: int | None = None,
    pooled_train: list[str | Path] = (),
    pooled_eval: list[str | Path] = (),
    hidden: HiddenSettings | str | None = None,
    runtime: VllmRuntime | str | None = None,
) -> dict[str, Any]:
    """Train (or resume), export to out_dir, return the training report.

    `family`: the drafter family (EAGLE-3 when None). `stop_after_step` ends the run early
    after that step's checkpoint (tests of resumption). `pooled_*`, `hidden`, `runtime`:
    shards whose states the capture servers give (set_up_training). `family`, `hidden` and
    `runtime` are objects or their JSON, as torchrun's processes get them.
    """
    family = FamilySettings.from_json(family) if isinstance(family, str) else family
    family = family or FamilySettings.eagle3()
    # What the family reads, as its job tracks it: the report and checkpoints record that.
    settings = settings.of_family(family.name, family.own_settings())
    hidden = HiddenSettings.from_json(hidden) if isinstance(hidden, str) else hidden
    runtime = VllmRuntime.from_json(runtime) if isinstance(runtime, str) else runtime
    training = set_up_training(
        train_shards=train_shards,
        eval_shards=eval_shards,
        target_head=target_head,
        draft_vocab=draft_vocab,
        journal_dir=journal_dir,
        settings=settings,
        family=family,
        pooled_train=pooled_train,
        pooled_eval=pooled_eval,
        hidden=hidden,
        runtime=runtime,
    )
    names = {
        "train_shards": [*train_shards, *pooled_train],
        "eval_shards": [*eval_shards, *pooled_eval],
    }
    try:
        shard_names = {key: [Path(p).stem for p in paths] for key, paths in names.items()}
        return run_training(training, Path(out_dir), shard_names, stop_after_step)
    finally:
        if training.states is not None:
            training.states.close()


def run_training(
    training: Training,
    out_dir: Path,
    shard_names: dict[str, list[str]],
    stop_after_step: int | None,
) -> dict[str, Any]:
    """The loop of `train_drafter`, from the last checkpoint on."""
    from tqdm import tqdm

    settings = training.settings
    processes, total_steps = training.processes, training.total_steps
    first_step = resume(training)
    metrics = None
    if processes.is_main:
        metrics = MetricsLog(training.journal_dir / METRICS_FILE, keep_until_step=first_step)
    model = data_parallel(training.model, processes)
    training.model.train()
    progress = Progress(step=first_step, started=time.perf_counter())
    bar = tqdm(
        total=total_steps,
        initial=first_step,
        desc="train drafter",
        file=sys.stderr,
        mininterval=2.0,
        disable=not processes.is_main,
    )
    batches = step_batches(training.plan, first_step, total_steps, training.epoch_steps, processes)
    if training.states is not None:  # the capture servers asked ahead, in the order read
        refs = step_refs(training.plan, first_step, total_steps, training.epoch_steps, processes)
        ask_ahead(training.plan.shards, (r for _, _, r in refs))
    if processes.device.startswith("cuda"):
        # Overlap reading with the GPU's work. On CPU a loader thread competes with the training
        # threads for the same cores (measured: 0.73 of a bare loop, against 0.96 reading in
        # line, where reading takes ~1% of the time).
        batches = prefetch(batches, depth=2)
    while progress.step < total_steps:
        loss = train_step(training, model, batches, progress)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", acc0=f"{progress.last.accuracy[0]:.2f}")
        log_step(training, progress, loss, metrics)
        if progress.step % settings.checkpoint_every == 0 or progress.step == total_steps:
            save_checkpoint(training, progress.step)
        if stop_after_step is not None and progress.step >= stop_after_step:
            bar.close()
            save_checkpoint(training, progress.step)
            return {"stopped_at_step": progress.step}
    bar.close()
    return finish(training, progress, metrics, out_dir, shard_names)


# --- torchrun: one process of the group (distributed.py launches them) -------------------------


def main(argv: list[str] | None = None) -> None:
    """Entry point of one torchrun process: `python -m eaglenest.stages.train.train ARGS.json`."""
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The job's threads (its rule's, from the adapter's use_threads), shared by its processes.
    use_threads(job_threads() // int(os.environ.get("WORLD_SIZE", "1")))
    train_drafter(**spec["arguments"], settings=TrainSettings.from_dict(spec["settings"]))
    leave_processes()


if __name__ == "__main__":
    main()
