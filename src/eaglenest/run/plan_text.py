"""`eaglenest plan`'s printout of a RunPlan (run/plan.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eaglenest.run.plan import RunPlan


def human_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def human_hours(h: float | None) -> str:
    if h is None:
        return "-"
    return f"{h:,.1f} h" if h >= 0.1 else f"{h * 60:,.1f} min"


def format_plan(plan: RunPlan) -> str:
    a = plan.assumptions
    title = (
        f"run {plan.run}: {plan.samples:,} samples in {plan.shards:,} shards of "
        f"{plan.shard_size:,} ({plan.train_shards:,} trained on, {plan.eval_shards:,} held out), "
        f"~{plan.tokens:,.3g} tokens"
    )
    lines = [
        title,
        f"hidden states: {plan.hidden_bytes_per_token:,} bytes/token (hidden size {a.hidden_size:,})",
        f"training reads ~{plan.train_tokens_per_epoch:,.3g} tokens an epoch (train.sequence)",
        "",
        f"{'stage':<12} {'jobs':>7} {'shards':>7} {'disk (files)':>13} {'hours':>10}  rules",
    ]
    for row in plan.stages:
        jobs = sum(row.jobs.values())
        if not jobs:
            continue
        rules = ", ".join(f"{rule} {n:,}" for rule, n in row.jobs.items() if n)
        disk = human_bytes(row.disk_bytes) if row.disk_bytes else "-"
        note = f" ({row.note})" if row.note else ""
        lines.append(
            f"{row.stage:<12} {jobs:>7,} {f'{row.shards:,}' if row.shards else '-':>7} {disk:>13} "
            f"{human_hours(row.hours):>10}  {rules}{note}"
        )
    header = (
        f"{'hidden.store':<14} {'capture jobs':>12} {'hidden disk':>12} {'total disk':>11} "
        f"{'capture hours':>14}"
    )
    lines += ["", header]
    for row in plan.stores:
        label = {"files": "files", "none": "none", "budget": f"budget {a.cache_gb:,.0f} GB"}
        kept = (
            f"first {row.stored_shards:,} training shard(s) stored (a fixed split)"
            if row.mode == "budget"
            else ""
        )
        line = (
            f"{label[row.mode]:<14} {row.extract_jobs:>12,} {human_bytes(row.hidden_bytes):>12} "
            f"{human_bytes(row.total_bytes):>11} {human_hours(row.capture_hours):>14}  "
            f"{kept}"
        )
        lines.append(line.rstrip())
    lines += ["", *(f"- {note}" for note in plan.notes)]
    return "\n".join(lines)
