"""The report's training section: the draft vocabulary, loss and accuracy per TTT step, and the
recipe the drafter was trained with (train_report.json)."""

from __future__ import annotations

from typing import Any

from eaglenest.settings.families import DRAFTER_VARIANTS, family_suffix
from eaglenest.stages.report.data import RunData
from eaglenest.stages.report.figures import training_figure
from eaglenest.stages.report.page import Section, fmt, key_values, pct, table


def draft_vocab_block(summary: dict[str, Any]) -> str:
    """The draft vocabulary: its size, and the share of completion tokens inside it (below 1,
    training skips the positions whose target token is outside and counts them)."""
    rows = [
        (
            "draft / target vocabulary (ids)",
            f"{fmt(summary['draft_vocab_size'])} / {fmt(summary['target_vocab_size'])}",
        ),
        ("distinct ids in completions", summary.get("distinct_ids_seen")),
        ("coverage of completion tokens", pct(summary["coverage"], 2)),
    ]
    return "<h3>Draft vocabulary</h3>" + key_values(rows)


def section_training(data: RunData) -> Section:
    section = Section("training", "Training: loss and accuracy per TTT step")
    if data.draft_vocab:
        section.blocks.append(draft_vocab_block(data.draft_vocab))
    folder = f"drafter{family_suffix(data.family)}"
    if data.train_lines is None and data.train_report is None:
        section.notes.append(
            f"Not trained yet: no {folder}/metrics.jsonl or {folder}/train_report.json."
        )
        return section
    train, heldout = data.train_lines or [], data.heldout_lines or []
    if train or heldout:
        section.figure = training_figure(train, heldout)
    else:
        section.notes.append(f"{folder}/metrics.jsonl has no lines yet.")
    report = data.train_report
    if report:
        section.blocks.append(
            key_values(
                [
                    ("steps / epochs", f"{fmt(report['steps'])} / {fmt(report.get('epochs'))}"),
                    ("TTT steps", report["ttt_steps"]),
                    ("train tokens", report.get("train_tokens")),
                    (
                        "wall (s) / tokens per s",
                        f"{fmt(report.get('wall_s'))} / {fmt(report.get('tokens_per_s'))}",
                    ),
                    ("held-out loss", report.get("heldout_loss")),
                    (
                        "tokens outside the draft vocab (skipped)",
                        pct(report.get("skipped_outside_vocab_share")),
                    ),
                    (
                        "train / held-out shards",
                        f"{len(report.get('train_shards') or [])} / "
                        + f"{len(report.get('eval_shards') or [])}",
                    ),
                ]
            )
        )
        if report.get("settings"):
            section.blocks.append("<h3>Recipe</h3>" + key_values(recipe_rows(report)))
        accuracy = [
            [f"step {i + 1}", a, _at(report.get("heldout_acc"), i)]
            for i, a in enumerate(report["train_acc"])
        ]
        section.blocks.append("<h3>Accuracy per TTT step (end of training)</h3>")
        section.blocks.append(table(["TTT step", "train", "held-out"], accuracy))
    else:
        section.notes.append(f"No {folder}/train_report.json: training has not finished.")
    return section


# family -> how the recipe names its drafting (before the EAGLE-3 layer it is built on)
DRAFTING: dict[str, str] = {
    "eagle3": "",
    "p_eagle": "P-EAGLE: its depths drafted in one forward",
    "dflash": "DFlash: a block drafted in one forward, non-causal inside it",
}


def recipe_rows(report: dict[str, Any]) -> list[tuple[str, Any]]:
    """What the drafter was trained with (train_report.json's `drafter` and `settings`); keys
    an older report lacks show their value before they existed."""
    settings, drafter = report["settings"], report.get("drafter") or {}
    get = settings.get
    slot_weights, inputs = drafted_slots(report)
    variant = [name for name in DRAFTER_VARIANTS if drafter.get(name)]
    architecture = "EAGLE-3 with " + ", ".join(variant) if variant else "EAGLE-3 (plain)"
    if DRAFTING.get(report.get("family")):
        architecture = f"{DRAFTING[report['family']]}; {architecture}"
    if drafter.get("sliding_window"):
        architecture += f"; attention within a {drafter['sliding_window']}-token sliding window"
    loss = (
        f"{get('loss', 'cross_entropy')}; target mass outside the draft vocab: "
        f"{get('target_outside_vocab', 'renormalise')}; "
        f"{slot_weights}; "
        f"on {get('loss_positions', 'completion')} positions"
    )
    betas = tuple(get("adam_betas", (0.9, 0.95)))
    optimiser = (
        f"AdamW lr {fmt(get('lr'))}, betas {betas}, weight decay {fmt(get('weight_decay'))}, "
        f"grad clip {fmt(get('grad_clip'))}"
    )
    schedule = (
        f"{get('warmup_steps')} warm-up steps, cosine to {fmt(get('min_lr_ratio'))} x lr; "
        f"{get('epochs')} epochs, {get('max_batch_tokens')} tokens a batch"
    )
    pool = get("shuffle_pool", 0)
    if get("packing", False):
        batches = "new each epoch, random samples packed several to a row"
    elif pool:
        batches = f"new each epoch, length-sorted in pools of {pool} batches' worth of tokens"
    else:
        batches = "the same length-sorted batches every epoch, reordered"
    return [
        ("architecture", architecture),
        ("loss", loss),
        ("drafted steps / their inputs", inputs),
        ("LM head", lm_head_row(report)),
        ("initialisation", f"N(0, {fmt(get('init_std'))})" if get("init_std") else "PyTorch's"),
        ("aux noise", fmt(get("aux_noise", 0.0))),
        ("optimiser", optimiser),
        ("schedule", schedule),
        ("batches", batches),
    ]


def lm_head_row(report: dict[str, Any]) -> str:
    """train.lm_head_init, or the target's own head where the drafter predicts with it (DFlash's
    train.dflash.head target: `drafter.head` of its report)."""
    if (report.get("drafter") or {}).get("head") == "target":
        return "the target's, frozen, over its whole vocabulary (not exported)"
    return report["settings"].get("lm_head_init", "random")


def drafted_slots(report: dict[str, Any]) -> tuple[str, str]:
    """How a family's loss weighs its drafted slots, and how many it drafts from what: the
    TTT keys are EAGLE-3's only (another family's settings leave them out)."""
    # An older report names no family: EAGLE-3's.
    return DRAFTED_SLOTS.get(report.get("family"), _ttt_slots)(report)


def _ttt_slots(report: dict[str, Any]) -> tuple[str, str]:
    settings = report["settings"]
    weights = f"TTT step i weighted {fmt(settings.get('step_weight'))}^i"
    return weights, f"{settings.get('ttt_steps')} / {settings.get('ttt_inputs', 'data')} tokens"


def _depth_slots(report: dict[str, Any]) -> tuple[str, str]:
    weights = "depth d weighted as speculators' COD sampling keeps it"
    return weights, f"{report['ttt_steps']} / mask tokens"


def _block_slots(report: dict[str, Any]) -> tuple[str, str]:
    gamma = (report.get("drafter") or {}).get("gamma")
    return (
        f"block slot j weighted exp(-(j - 1) / {fmt(gamma)})",
        f"{report['ttt_steps']} / mask tokens",
    )


# family -> how its loss weighs its drafted slots (recipe_rows)
DRAFTED_SLOTS = {"eagle3": _ttt_slots, "p_eagle": _depth_slots, "dflash": _block_slots}


def _at(values: list | None, i: int) -> Any:
    return values[i] if values and i < len(values) else None
