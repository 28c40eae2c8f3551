"""The check of the vLLM backend against the transformers one (`hidden.verify_samples: N`),
run before any shard is captured: the first N samples of the first shard by both, stored exactly
(fp32, the final hidden state), compared layer by layer.

A drafter is served on the engine's features; one trained on features that differ (a kernel bug,
another rotary layout) loses acceptance silently. Per layer: for each token
|vLLM - transformers| / |transformers| over the hidden size, the largest and the mean over
tokens; above `hidden.verify_tolerance` the job fails with them, else `hidden/verify.json` keeps
them for the report.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from eaglenest.common.io import write_json
from eaglenest.formats.hidden_shard import open_hidden_shard
from eaglenest.settings.hidden_states import HiddenSettings, HiddenVerifySettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.hidden_states.extract import extract_hidden_states
from eaglenest.stages.hidden_states.vllm_backend import capture_hidden_states_vllm

log = logging.getLogger(__name__)


class BackendMismatchError(RuntimeError):
    """vLLM's states are not transformers' on the same tokens; the message has the figures."""


def layer_agreement(engine, reference) -> dict[str, dict[str, float]]:
    """Per aux layer (by id) and the final hidden state: the largest and mean per-token
    relative difference over every sample of two shards of the same tokens."""
    ids = [str(i) for i in reference.aux_layer_ids]
    errors: dict[str, list[torch.Tensor]] = {name: [] for name in [*ids, "final"]}
    for i in range(len(reference)):
        a, b = engine.sample(i), reference.sample(i)
        pairs = zip(a["aux"].float().chunk(len(ids), -1), b["aux"].float().chunk(len(ids), -1))
        for name, (x, y) in zip(ids, pairs, strict=True):
            errors[name].append((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-30))
        x, y = a["final_hidden"].float(), b["final_hidden"].float()
        errors["final"].append((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-30))
    out = {}
    for name, parts in errors.items():
        values = torch.cat(parts)
        out[name] = {"max_relative": float(values.max()), "mean_relative": float(values.mean())}
    return out


def _first_samples(tokens: Path, n: int, out: Path) -> int:
    from eaglenest.formats.tokens import read_tokens  # polars: see capture/answer.sample_rows

    frame = read_tokens(tokens).head(n)
    frame.write_parquet(out)
    return frame.height


def verify_backends(
    *,
    tokens: str | Path,
    out: str | Path,
    settings: HiddenSettings,
    verify: HiddenVerifySettings,
    runtime: VllmRuntime,
) -> dict[str, Any]:
    """Capture the first `verify.samples` samples of `tokens` with both backends, write the
    per-layer figures to `out`, and fail above `verify.tolerance` (the figures stay in `out`'s
    place only when they pass; the error message carries them either way)."""
    if settings.backend != "vllm":
        raise ValueError(
            f"hidden.verify_samples checks the vllm backend against transformers; hidden.backend "
            f"is {settings.backend!r}"
        )
    exact = replace(settings, dtype="fp32", target_signal="final_hidden")
    with tempfile.TemporaryDirectory(prefix="eaglenest-verify-") as work:
        work_dir = Path(work)
        subset = work_dir / "tokens.parquet"
        n = _first_samples(Path(tokens), verify.samples, subset)
        engine, reference = work_dir / "vllm.safetensors", work_dir / "transformers.safetensors"
        capture_hidden_states_vllm(tokens=subset, out=engine, settings=exact, runtime=runtime)
        transformers_exact = replace(exact, backend="transformers", engine=None)
        extract_hidden_states(tokens=subset, out=reference, settings=transformers_exact)
        agreement = layer_agreement(open_hidden_shard(engine), open_hidden_shard(reference))
    worst = max(figures["max_relative"] for figures in agreement.values())
    result = {
        "tokens": str(tokens),
        "samples": n,
        "model_dtype": settings.model_dtype,
        "tolerance": verify.tolerance,
        "largest": worst,
        "passed": worst <= verify.tolerance,
        "layers": agreement,
    }
    table = ", ".join(f"{name}: {f['max_relative']:.2e}" for name, f in agreement.items())
    if not result["passed"]:
        raise BackendMismatchError(
            f"{tokens}: on its first {n} samples vLLM's hidden states differ from "
            f"transformers' by up to {worst:.3g} (relative, per token) above "
            f"hidden.verify_tolerance {verify.tolerance}; largest per layer: {table}. A drafter "
            "trained on one backend's features would be served on the other's: find the cause "
            "(README, known issues) before capturing"
        )
    log.info("vLLM and transformers agree on %d samples: %s", n, table)
    write_json(out, result)
    return result
