"""DDP training (train.gpus > 1) with unequal batches: the step's loss, its gradients and the logged
metrics are those of one process training on the union of the ranks' batches (the mean over
all positions), not an average of the ranks' own means, for every drafter family
(stages/train/families.py). Two CPU ranks talking over gloo."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.drafter_sizes import CONFIG

from eaglenest.common.config import validate_config
from eaglenest.drafter.batches import Batch
from eaglenest.drafter.dflash.model import DFlashConfig, DFlashDrafter
from eaglenest.drafter.eagle3.model import Eagle3Drafter
from eaglenest.drafter.p_eagle.model import PEagleDrafter
from eaglenest.settings.train import FamilySettings, TrainSettings
from eaglenest.stages.train.distributed import Processes, data_parallel
from eaglenest.stages.train.families import DFlash, Eagle3, PEagle
from eaglenest.stages.train.train import Progress, Training, train_step

LENGTH = 12
TTT_STEPS = 3


def make_batch(rows: int, loss_positions: int, seed: int) -> Batch:
    """`rows` samples of LENGTH tokens, the first `loss_positions` positions of each in the loss;
    about one position in six has a target argmax outside the draft vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    loss_mask = torch.zeros(rows, LENGTH, dtype=torch.bool)
    loss_mask[:, :loss_positions] = True
    return Batch(
        aux=torch.randn(rows, LENGTH, 3 * CONFIG.target_hidden_size, generator=generator),
        input_ids=torch.randint(0, CONFIG.vocab_size, (rows, LENGTH), generator=generator),
        loss_mask=loss_mask,
        target_logits=3 * torch.randn(rows, LENGTH, CONFIG.draft_vocab_size, generator=generator),
        in_draft_vocab=torch.rand(rows, LENGTH, generator=generator) > 1 / 6,
        samples=[("shard", seed * 100 + row) for row in range(rows)],
    )


# Rank 0: many loss positions; rank 1: a few.
RANK_BATCHES = ((3, LENGTH, 10), (1, 4, 11))


def rank_batch(rank: int) -> Batch:
    return make_batch(*RANK_BATCHES[rank])


def union_batch() -> Batch:
    parts = [rank_batch(rank) for rank in range(len(RANK_BATCHES))]
    joined = {name: torch.cat([getattr(b, name) for b in parts]) for name in Batch.TENSORS[:5]}
    return Batch(**joined, samples=[s for b in parts for s in b.samples])


class FilledSignal:
    """The batches come with their target logits already: `fill` leaves them as they are."""

    def fill(self, batch: Batch) -> Batch:
        return batch


MASK = CONFIG.vocab_size - 1


def drafter(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "eagle3":
        model = Eagle3Drafter(CONFIG)
    elif family == "p_eagle":
        model = PEagleDrafter(CONFIG, MASK)
    else:
        model = DFlashDrafter(
            DFlashConfig.from_drafter(CONFIG, num_hidden_layers=1, block_size=3, mask_token_id=MASK)
        )
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
    d2t = torch.arange(0, 2 * CONFIG.draft_vocab_size, 2) - torch.arange(CONFIG.draft_vocab_size)
    t2d = torch.zeros(CONFIG.vocab_size, dtype=torch.bool)
    t2d[torch.arange(0, 2 * CONFIG.draft_vocab_size, 2)] = True
    model.set_vocab(d2t, t2d)
    return model.train()


RECIPES = {"eagle3": Eagle3, "p_eagle": PEagle, "dflash": DFlash}


def one_step(processes: Processes, batch: Batch, family: str) -> dict:
    """train_step on `batch` (this rank's), with the gradients the optimizer was about to apply."""
    train = {
        "ttt_steps": TTT_STEPS,
        "step_weight": 0.8,
        "grad_clip": 1e9,
        "device": "cpu",
        "dflash": {"block_size": 3},
        "mask_token_id": MASK,
    }
    config = validate_config({"train": train})
    settings = TrainSettings.from_config(config)
    model = drafter(family)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(parameters, lr=0.0)
    grads = {}

    def keep_grads(*_):
        grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})

    optimizer.register_step_pre_hook(keep_grads)
    training = Training(
        settings=settings,
        processes=processes,
        recipe=RECIPES[family](model, settings, FamilySettings.of(config, family)),
        parameters=parameters,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        signal=FilledSignal(),
        plan=None,
        eval_plan=None,
        epoch_steps=[1],
        total_steps=1,
        fingerprint="",
        journal_dir=Path("."),
    )
    progress = Progress(step=0, started=time.perf_counter())
    loss = train_step(training, data_parallel(model, processes), iter([(0, 0, batch)]), progress)
    return {
        "loss": loss,
        "acc": progress.last.accuracy,
        "loss_tokens": progress.loss_tokens,
        "skipped": progress.skipped_outside_vocab,
        "grads": grads,
    }


def run_rank(rank: int, world_size: int, rendezvous: str, out_dir: str, family: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size
    )
    try:
        result = one_step(Processes(rank, world_size, "cpu"), rank_batch(rank), family)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", list(RECIPES))
def test_two_ranks_with_unequal_batches_step_like_one_process_on_their_union(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    world_size = len(RANK_BATCHES)
    mp.spawn(
        run_rank,
        args=(world_size, str(tmp_path / "rendezvous"), str(tmp_path), family),
        nprocs=world_size,
        join=True,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    alone = one_step(Processes(), union_batch(), family)

    assert alone["loss_tokens"] > 0 and alone["skipped"] > 0
    local = [int(rank_batch(r).loss_mask.sum()) for r in range(world_size)]
    assert local[0] > 5 * local[1], "the test wants unequal batches"
    for result in ranks:
        assert result["loss"] == pytest.approx(alone["loss"], rel=1e-5)
        assert result["acc"] == pytest.approx(alone["acc"], rel=1e-9)
        assert (result["loss_tokens"], result["skipped"]) == (
            alone["loss_tokens"],
            alone["skipped"],
        )
        assert result["grads"].keys() == alone["grads"].keys()
        for name, grad in alone["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-5, atol=1e-7)
