"""Simulated acceptance, from stored features: at every position t whose next token x[t+1] is a
completion token, the drafter runs its chain of K steps (the training-time-test forward with K
steps) and step i is compared with the target's greedy token at position t+1+i. Feeding the data
token x[t+1+i] to step i equals feeding the drafter's own prediction as long as the chain has
matched so far, except where the stored (sampled) token differs from the greedy one: there the
real chain would continue on a sequence we have no features for, so it is counted up to that
token and cut (reported as `cut_by_sampling`). Only positions with room for K steps count.

The families that draft in one forward are simulated as vLLM drafts them. P-EAGLE's depths take
the mask token, never a drafted one, so its chain is its parallel states over the data
(`PEagleDrafter.teacher_forced_states`): at t, depth d sees the depth-0 keys of positions <= t
and its own chain's masks, the keys of vLLM's one forward after verifying t + 1. DFlash drafts
the block at anchor t + 1 ([x_t+1, mask x K], the context of positions <= t: what vLLM's
proposer queries when x_t+1 is the bonus token) in one forward (`block_predictions`), any K up
to block_size - 1. Both count as EAGLE-3's chains do (`AcceptanceCounts`).

Baselines on the same data: an untrained drafter (same architecture and initialisation seed) and
prompt lookup (n-gram drafting from the context)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from math import isqrt
from typing import Any

import numpy as np
import torch

from eaglenest.capture.reader import ask_ahead
from eaglenest.drafter.batches import Batch, BatchPlan, TargetSignal, build_batch
from eaglenest.drafter.dflash.decode import DFlashContext, draft_blocks, extend_context
from eaglenest.drafter.dflash.model import DFlashDrafter
from eaglenest.drafter.eagle3.model import Eagle3Drafter
from eaglenest.drafter.p_eagle.model import PEagleDrafter
from eaglenest.formats.metrics import SimulatedFigures
from eaglenest.settings.evaluate import EvaluateSettings
from eaglenest.settings.families import block_served_k

log = logging.getLogger(__name__)

Drafter = Eagle3Drafter | PEagleDrafter | DFlashDrafter
# Query-key pairs of one simulated DFlash forward (blocks over a row's context), a bound on its
# attention's memory (~130 MB at 8 heads): a 9,000-token sample drafts 29 blocks of 8 a call.
BLOCK_ATTENTION_CELLS = 2**22


@dataclass
class AcceptanceCounts:
    k: int
    positions: int = 0
    accepted: int = 0
    reached: np.ndarray | None = None  # chains that got to step i
    hits: np.ndarray | None = None  # of those, step i matched
    cut_by_sampling: int = 0

    def __post_init__(self):
        self.reached = np.zeros(self.k, dtype=np.int64)
        self.hits = np.zeros(self.k, dtype=np.int64)

    def add(self, predicted: torch.Tensor, greedy: torch.Tensor, data_next: torch.Tensor) -> None:
        """Chains [N, K]: draft i, the target's greedy token there, and the stored token after
        the draft's position (the input of step i+1)."""
        match = predicted == greedy
        goes_on = match & (data_next == greedy)
        reached = torch.ones_like(match)
        reached[:, 1:] = goes_on[:, :-1].cumprod(dim=1).bool()
        accepted = reached & match
        self.positions += int(predicted.shape[0])
        self.accepted += int(accepted.sum())
        self.reached += reached.sum(0).cpu().numpy()
        self.hits += accepted.sum(0).cpu().numpy()
        self.cut_by_sampling += int((accepted & ~goes_on).sum())

    def result(self) -> dict[str, Any]:
        figures = SimulatedFigures(
            acceptance_length=1 + self.accepted / max(self.positions, 1),
            conditional_acceptance=[
                float(h / r) if r else 0.0 for h, r in zip(self.hits, self.reached, strict=True)
            ],
            positions=self.positions,
            cut_by_sampling=self.cut_by_sampling,
        )
        return figures.to_json()


def chain_positions(loss_mask: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] bool: t where x[t+1] is a completion token and steps up to t+1+k stay inside."""
    b, t = loss_mask.shape
    index = torch.arange(t)[None].expand(b, t)
    next_is_completion = torch.zeros_like(loss_mask)
    next_is_completion[:, :-1] = loss_mask[:, 1:]
    return next_is_completion & (index + 1 + k <= lengths[:, None] - 1)


def shifted_stack(x: torch.Tensor, first: int, k: int, fill: int = -1) -> torch.Tensor:
    """[B, T, K]: out[:, t, i] = x[:, t + first + i]."""
    b, t = x.shape
    padded = torch.cat([x, torch.full((b, first + k), fill, dtype=x.dtype)], dim=1)
    return torch.stack([padded[:, first + i : first + i + t] for i in range(k)], dim=-1)


def greedy_target_ids(batch: Batch, signal: TargetSignal) -> torch.Tensor:
    """The target's greedy token at each position of a filled batch (on the CPU), as a target
    id; -1 where it is outside the draft vocabulary."""
    greedy_draft = batch.target_logits.argmax(-1).cpu()
    return torch.where(batch.in_draft_vocab.cpu(), signal.draft_ids.cpu()[greedy_draft], -1)


@torch.no_grad()
def simulate(
    proposers: dict[str, Drafter | int],
    plan: BatchPlan,
    signal: TargetSignal,
    ks: tuple[int, ...],
    device: str = "cpu",
    depths: tuple[int, ...] = (),
    window: int = 0,
) -> dict[str, dict[str, Any]]:
    """Simulated acceptance for each proposer (a drafter, or an int = prompt-lookup n-gram).
    With `depths`, also the first proposer's at the positions at or past each depth, under
    "by_depth": depth (str) -> K (str) -> figures; with `window` (the tokens decoded from each
    depth's cut), beside them under "window" its figures over only the positions that decoding
    covers (`decoded_window`): past d counts the whole rest of the answer, which at depth 0
    weighs an answer's easy depths into a figure its first tokens are compared with."""
    counts = {name: {k: AcceptanceCounts(k) for k in ks} for name in proposers}
    first = next(iter(proposers))
    by_depth = {d: {k: AcceptanceCounts(k) for k in ks} for d in depths}
    by_window = {d: {k: AcceptanceCounts(k) for k in ks} for d in depths if window}
    kmax = max(ks)
    order = plan.epoch_order(0)
    ask_ahead(plan.shards, order)  # states from the capture servers (hidden.store none/budget)
    for refs in order:
        on_device = signal.fill(build_batch(refs, plan.shards, plan.aux_layer_ids).to(device))
        batch = on_device.to("cpu")
        lengths = torch.tensor([r.length for r in refs])
        past = {depth: answer_past(batch.loss_mask, depth) for depth in depths}  # once a batch
        greedy = greedy_target_ids(batch, signal)
        greedy_next = shifted_stack(greedy, 1, kmax)  # what step i must match
        data_next = shifted_stack(batch.input_ids, 2, kmax)  # the input of step i + 1
        for name, proposer in proposers.items():
            if isinstance(proposer, int):
                predicted = lookup_predictions(
                    batch.input_ids, lengths, batch.loss_mask, kmax, proposer
                )
            else:
                start = chain_positions(batch.loss_mask, lengths, min(ks))
                predict = PREDICTIONS[proposer.family]
                predicted = predict(proposer, on_device, start, greedy_next, data_next, kmax)
            for k in ks:
                where = chain_positions(batch.loss_mask, lengths, k)
                chains = (predicted[..., :k], greedy_next[..., :k])
                counts[name][k].add(chains[0][where], chains[1][where], data_next[where, :k])
                for depth in depths if name == first else ():
                    deep = where & past[depth]
                    by_depth[depth][k].add(chains[0][deep], chains[1][deep], data_next[deep, :k])
                    if window:
                        near = where & decoded_window(batch.loss_mask, lengths, depth, window)
                        by_window[depth][k].add(
                            chains[0][near], chains[1][near], data_next[near, :k]
                        )
    results = {
        name: {str(k): c.result() for k, c in per_k.items()} for name, per_k in counts.items()
    }
    if depths:
        results["by_depth"] = {
            str(d): {
                str(k): {**c.result(), **({"window": by_window[d][k].result()} if window else {})}
                for k, c in per_k.items()
            }
            for d, per_k in by_depth.items()
        }
    return results


def answer_past(loss_mask: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, T] bool: the positions at or past generated depth `depth` (the answer's start + depth,
    as depths.py `cut_sample` cuts)."""
    answer_start = loss_mask.to(torch.int8).argmax(1)  # the first completion token
    return torch.arange(loss_mask.shape[1])[None] >= (answer_start + depth)[:, None]


def decoded_window(loss_mask: torch.Tensor, lengths: torch.Tensor, depth: int, width: int):
    """[B, T] bool: the positions whose drafts a decoding from the `depth` cut makes (depths.py
    `cut_sample`): the cut c is the answer's start + `depth`; its `width` new tokens are drafted
    from positions c - 1 .. c + width - 2; only in the rows that cut keeps (long enough)."""
    answer_start = loss_mask.to(torch.int8).argmax(1)  # the first completion token
    cut = answer_start + depth
    kept = lengths >= cut + width
    position = torch.arange(loss_mask.shape[1])[None]
    return kept[:, None] & (position >= cut[:, None] - 1) & (position < (cut + width - 1)[:, None])


def chain_predictions(
    drafter: Eagle3Drafter | PEagleDrafter,
    batch,
    start: torch.Tensor,
    greedy_next: torch.Tensor,
    data_next: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """[B, T, K] the drafter's step-i draft (a target id) at each position whose chain reaches
    step i: from the positions in `start`, on while each step matches the target's greedy token
    and the data goes on with it (AcceptanceCounts' `reached`); -3 (no token) elsewhere. The
    LM head runs only there: the counts are those of every position's whole chain, for a
    fraction of the head's cost (a chain mostly ends at its first or second step)."""
    b, t = start.shape
    predicted = torch.full((b, t, k), -3, dtype=torch.long)
    alive = start.clone()
    steps = drafter.teacher_forced_states(batch.aux, batch.input_ids, k)
    for i, normed in enumerate(steps):
        rows = alive.to(normed.device)
        draft = drafter.lm_head(normed[rows]).argmax(-1)
        predicted[..., i][alive] = drafter.draft_to_target(draft).cpu()
        goes_on = data_next[..., i] == greedy_next[..., i]
        alive &= (predicted[..., i] == greedy_next[..., i]) & goes_on
        if not alive.any():
            break
    return predicted


def block_predictions(drafter: DFlashDrafter, batch, start: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T, K] the DFlash block's drafts (target ids) at each position t in `start`: the
    block at anchor t + 1 with bonus token x_t+1 (module doc); -3 (no token) elsewhere. A row's
    context keys are computed once, its blocks drafted BLOCK_ATTENTION_CELLS at a time."""
    b, t = start.shape
    if not 1 <= k <= block_served_k(drafter.config.block_size):
        raise ValueError(
            f"a DFlash drafter of block_size {drafter.config.block_size} drafts K = "
            f"1..{block_served_k(drafter.config.block_size)}, not {k}"
        )
    size = k + 1  # vLLM's block at K: [bonus, mask x K]
    predicted = torch.full((b, t, k), -3, dtype=torch.long)
    # n blocks: n·size queries over t + n·size keys, at most BLOCK_ATTENTION_CELLS pairs.
    chunk = max(
        1, min(BLOCK_ATTENTION_CELLS // (2 * size * t), isqrt(BLOCK_ATTENTION_CELLS // 2) // size)
    )
    for row in range(b):
        positions = start[row].nonzero()[:, 0]
        if positions.numel() == 0:
            continue
        context = DFlashContext()
        extend_context(drafter, context, batch.aux[row])
        for at in positions.split(chunk):
            bonus = batch.input_ids[row, (at + 1).to(batch.input_ids.device)]
            logits = draft_blocks(drafter, context, bonus, at + 1, k)
            drafts = drafter.draft_to_target(logits[:, 1:].argmax(-1))
            predicted[row, at] = drafts.cpu()
    return predicted


def block_predictions_of_chains(
    drafter: DFlashDrafter, batch, start: torch.Tensor, greedy_next, data_next, k: int
) -> torch.Tensor:
    """`block_predictions` in `chain_predictions`' signature (a block depends on no earlier
    draft: the greedy and data tokens are not read)."""
    return block_predictions(drafter, batch, start, k)


# family -> its drafts at every position whose chain starts there (the module doc says how each
# family's drafting is simulated)
PREDICTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "eagle3": chain_predictions,
    "p_eagle": chain_predictions,
    "dflash": block_predictions_of_chains,
}


def lookup_predictions(
    input_ids: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor, k: int, ngram: int
) -> torch.Tensor:
    """[B, T, K] prompt-lookup drafts at every drafting position (-2 where it proposes nothing):
    at each position, `prompt_lookup` of the context so far, from an index of each n-gram's
    latest start that grows with the context (linear in a sample's length; searching the
    context at each position was quadratic: minutes for the long demo's 9,000-token samples)."""
    b, t = input_ids.shape
    out = torch.full((b, t, k), -2, dtype=torch.long)
    for row in range(b):
        ids = input_ids[row, : int(lengths[row])].tolist()
        latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram + 1)]
        for pos in range(len(ids) - 1):
            size = pos + 2  # the context is ids[:size]
            # The n-grams that now start early enough to have a token after them in the context.
            for n in range(1, ngram + 1):
                start = size - n - 1
                if start >= 0:
                    latest[n][tuple(ids[start : start + n])] = start
            if not loss_mask[row, pos + 1]:
                continue
            for n in range(min(ngram, size - 1), 0, -1):
                start = latest[n].get(tuple(ids[size - n : size]))
                if start is not None:
                    drafts = ids[start + n : min(start + n + k, size)]
                    out[row, pos, : len(drafts)] = torch.tensor(drafts, dtype=torch.long)
                    break
    return out


def untrained_dflash(model: DFlashDrafter) -> DFlashDrafter:
    """A fresh DFlash drafter; with the target's head, that head (never trained: the twin
    differs from the trained drafter by what training changes only)."""
    fresh = DFlashDrafter(model.config)
    if model.config.target_head:
        fresh.lm_head.weight.data.copy_(model.lm_head.weight.data)
    return fresh


# family -> a drafter of the same architecture as a trained one, freshly initialised
UNTRAINED: dict[str, Callable[[Any], Drafter]] = {
    "eagle3": lambda model: Eagle3Drafter(model.config),
    "p_eagle": lambda model: PEagleDrafter(
        model.config, model.mask_token_id, model.num_hidden_layers, model.train_mask_embedding
    ),
    "dflash": untrained_dflash,
}


def untrained_like(model: Drafter, seed: int) -> Drafter:
    """The same family's drafter, freshly initialised from `seed`, with its embedding and
    draft vocabulary."""
    torch.manual_seed(seed)
    fresh = UNTRAINED[model.family](model)
    fresh.embed_tokens.weight.data.copy_(model.embed_tokens.weight.data)
    fresh.set_vocab(model.d2t, model.t2d)
    return fresh.to(model.fc.weight.device).eval()


def simulate_all(
    drafter: Drafter,
    shards: list,
    signal: TargetSignal,
    settings: EvaluateSettings,
    device,
    family: str = "eagle3",
) -> dict[str, dict[str, Any]]:
    """`simulate` of the drafter (under its family's name), its untrained twin and prompt
    lookup on the held-out shards."""
    untrained = untrained_like(drafter, settings.seed)
    layers = drafter.config.aux_layer_ids  # its columns of the captured aux
    plan = BatchPlan(shards, settings.max_batch_tokens, settings.seed, aux_layer_ids=layers)
    proposers = {family: drafter, "untrained": untrained}
    proposers["prompt_lookup"] = settings.prompt_lookup_ngram
    window = settings.live_max_new_tokens  # what each depth's cut is decoded for
    return simulate(proposers, plan, signal, settings.ks, device, settings.depths, window)
