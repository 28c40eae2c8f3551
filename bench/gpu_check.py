"""One prepared GPU check: every CUDA path of the project, in one script of a few minutes.

Each step runs the project's own functions on the device (`--device`, default cuda) and compares
them with the CPU in float32, printing one line `gpu-check <name> ok|FAIL <figures>` and going on
after a failure:

- gpus: `common/gpus.py` counts the GPUs with nvidia-smi as torch does, and its file locks claim
  one and refuse it to a second claim;
- ttt: loss and gradients of 7 TTT steps (`drafter.Eagle3Drafter`, `train.ttt_loss`) on the device
  in float32 and under bf16 autocast (`train.autocast`), the causal log-sum-exp in one chunk and
  in many, against the CPU float32 run (the oracle of tests/unit/drafter/eagle3/test_drafter.py,
  which checks it against the [T, T] attention); the log-sum-exp stays float32 under autocast;
- long_context: one 7-step TTT training step (bench/train.py `long_context_step`) at T = 2K, 8K,
  16K, 32K at Llama-3-8B drafter sizes (H 4096, 32 heads, 8 kv heads, MLP 14336, vocabulary
  128,256, draft vocabulary 32,000; bf16 autocast, one sample): `max_memory_allocated` and
  tokens/s per T and the 32K / 8K memory ratio (goal <= 4.5: linear in T);
- packed: a packed batch (`BatchPlan(packed=True)`, `build_packed_batch`) through the dense masked
  block and through the linear-memory path gives the loss and gradients of the same samples one
  to a row (`build_batch`);
- train: `train_drafter` on synthetic shards (tests/support/synthetic_run.py, the demo's sizes)
  on the CPU in float32, on the device in float32 and in bf16: the loss curves agree;
- capture: the transformers capture backend (`load_target`, `AuxCapture`, `forward_batch`) on a
  random Qwen3 target: aux states, final hidden states and top-k on the device against the CPU;
- fp8: `fp8_quantize` / `fp8_dequantize` on the device against the CPU, and a fp8 hidden shard
  written from device tensors (`create_hidden_shard`) read back (`open_hidden_shard`) and decoded
  on the device;
- ddp: in a child process, a one-process group over NCCL (gloo on the CPU) runs the project's DDP
  path (`data_parallel`, `ttt_loss` and `train_step` with their all-reduces). One GPU allows a
  group of one process only (NCCL refuses two ranks on one device) and the helpers take their DDP
  branches above one process only, so they are handed world_size 2 over that group: every
  all-reduce sums one rank, `ttt_loss` doubles the loss for DDP's average over the (one) rank, so
  the gradients must be twice a plain step's and the step's reported loss the plain one's;
- device_timings: bench/_device_timings.py on the device (a Llama-3-8B-wide decoder of plain
  torch in CUDA graphs, at batch 1, 8 and 32): one drafter forward over one target decode step
  and verifying K + 1 tokens over one step, written as device_timings.json under $OUT (and
  `--timings-json`), the file `report.device.file` points the report's family choice at
  (docs/report.md); the file must pass report.device's checks.
- vllm_mla_dflash: a DFlash drafter beside an MLA target with YaRN (Kimi-K2.5's kind) in vLLM
  (bench/gpu_vllm_mla.py), in a child process of `--vllm-python` (else this python, when it has
  vLLM; without one the step is skipped): greedy past the unscaled positions equals plain greedy
  and vLLM drafted. vLLM's CPU build refuses the pair (the figures say why); a GPU must serve it.

Needs only python, torch, transformers (with its pyyaml), safetensors, tqdm and numpy plus the
project's source: no Snakemake, polars, pandera, jsonschema, httpx or vLLM, no wheel to carry
(tests/bench/test_gpu_check.py runs it in an environment of only those packages, httpx blocked). Steps have time budgets (`BUDGET_S`, 645 s in all) checked between
their parts, and a step that would start after TOTAL_BUDGET_S is not run, so on an H200 the whole
check ends in well under 8 minutes. The lines and a JSON file (`gpu_check.log`,
`gpu_check.json`) are written under $OUT when it is set, after every step, so a killed run keeps
what it has; `--json PATH` writes the JSON there too (bench/run_all.py).

Usage: PYTHONPATH=src python bench/gpu_check.py [--device cuda|cpu] [--small] [--only STEP ...]
                                                 [--json PATH] [--timings-json PATH]
                                                 [--vllm-python PATH]
`--small`: small sizes (the CPU test); `--device cpu`: the CPU against itself (a dry run).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglenest.drafter import attention as drafter_attention
from eaglenest.drafter.attention import causal_logsumexp
from eaglenest.drafter.batches import Batch, BatchPlan, TargetSignal, build_batch
from eaglenest.drafter.config import DrafterConfig
from eaglenest.drafter.eagle3.model import Eagle3Drafter, ttt_forward
from eaglenest.stages.train.distributed import Processes, autocast
from eaglenest.stages.train.loss import ttt_loss

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
# Seconds each step may take on an H200, checked between its parts (estimates from FLOP counts:
# not yet measured on one; each step should take well under its budget).
BUDGET_S = {
    "gpus": 10,
    "ttt": 30,
    "long_context": 150,
    "packed": 20,
    "train": 45,
    "capture": 40,
    "fp8": 10,
    "ddp": 40,
    "device_timings": 60,
    "vllm_mla_dflash": 240,  # two eager engine starts and a tiny target and drafter
}
# No step starts after this many seconds of the check: the whole stays under 8 minutes.
TOTAL_BUDGET_S = 420
# Tolerances: relative errors ||device - cpu|| / ||cpu||. float32 on CUDA differs from the CPU by
# summation order only; bf16 (8 significant bits) by ~0.4% per rounding. Measured on the CPU at
# the full sizes, bf16 against float32: TTT loss 1e-6, gradients 8e-3 (the worst tensor); packed
# gradients 5e-3; capture (bf16 weights, 12 layers) aux 1.7e-2, final hidden 1.9e-2; the 40-step
# loss curve 4.8e-5 (float32 on one thread against two: 2e-7).
TOL = {
    "fp32_loss": 1e-4,
    "fp32_grad": 1e-3,
    "bf16_loss": 5e-3,
    "bf16_grad": 6e-2,
    "lse_bf16": 2e-3,
    "packed_loss": 1e-5,
    "packed_grad": 1e-4,
    "curve_fp32": 1e-3,
    "curve_bf16": 1e-2,
    "capture_fp32": 1e-4,
    "capture_bf16": 5e-2,
    "topk_agree_fp32": 0.99,
    "fp8_roundtrip": 0.05,
    # fp8 encoded on the device as on the CPU; a rounding that differs moves a value one fp8 step
    # (6%): 0.1% of them would make a relative error of 2e-3.
    "fp8_equal_share": 0.999,
    "fp8_shard": 5e-3,
    "ddp": 1e-5,
    "long_context_ratio": 4.5,
}
# Sizes of the steps; "small" for --small (the CPU test, seconds a step on two cores).
TTT_SIZES = {
    "full": {"hidden": 512, "heads": 8, "kv_heads": 2, "head_dim": 64, "mlp": 1536,
             "vocab": 8192, "draft": 2048, "batch": 2, "length": 1024, "steps": 7},
    "small": {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "mlp": 128,
              "vocab": 300, "draft": 100, "batch": 2, "length": 48, "steps": 4},
}  # fmt: skip
LONG_CONTEXT_LENGTHS = {"full": (2048, 8192, 16384, 32768), "small": (64, 256)}
TRAIN_STEPS = {"full": 40, "small": 4}
CAPTURE_SIZES = {
    "full": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
             "vocab_size": 16384, "lengths": (300, 257, 128, 64)},
    "small": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 300, "lengths": (20, 13, 7)},
}  # fmt: skip
FP8_SIZES = {"full": (2048, 4096), "small": (64, 32)}  # tokens, hidden size


class CheckFailed(AssertionError):
    """A figure outside its tolerance; the message says which, the figures are still kept."""


class StepSkipped(Exception):
    """A step that cannot run here (what it needs is not installed): neither ok nor failed."""


@dataclasses.dataclass
class Context:
    device: str
    small: bool
    root: Path  # a temporary folder for the step's files
    deadline: float = 0.0  # time.perf_counter() by which the current step should end
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)
    vllm_python: str | None = None  # a python with vLLM (`--vllm-python`)
    timings_json: Path | None = None  # where device_timings writes its file (also under $OUT)

    @property
    def size(self) -> str:
        return "small" if self.small else "full"

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()


def rel_err(found: torch.Tensor, expected: torch.Tensor) -> float:
    """||found - expected|| / ||expected|| in float64 on the CPU."""
    found, expected = found.detach().double().cpu(), expected.detach().double().cpu()
    return float((found - expected).norm() / expected.norm().clamp_min(1e-30))


def check(figures: dict, name: str, value: float, tolerance: float, at_most: bool = True) -> None:
    """Record a figure and fail the step when it lies outside its tolerance."""
    figures[name] = value
    bad = value > tolerance if at_most else value < tolerance
    if bad or math.isnan(value):
        relation = "<=" if at_most else ">="
        raise CheckFailed(f"{name}={value:.3g}, goal {relation} {tolerance:g}")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_train():
    """bench/train.py as a module (its long-context step and synthetic shards)."""
    if "gpu_check_bench_train" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "gpu_check_bench_train", BENCH_DIR / "train.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[spec.name]  # the next step tries again, and says why it failed
            raise
    return sys.modules["gpu_check_bench_train"]


def schema_config(**sections: Any) -> dict[str, Any]:
    """A config of these sections with config/schema.yaml's defaults filled in, as
    `common.config.validate_config` fills them, without its validation: jsonschema is not on the
    GPU machine (pyyaml is, with transformers)."""
    import yaml

    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    return _with_defaults(schema, copy.deepcopy(sections))


def _with_defaults(schema: dict, value: Any) -> Any:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _with_defaults(sub, value[name])
    return value


def train_settings(**train: Any):
    from eaglenest.settings.train import TrainSettings

    return TrainSettings.from_config(schema_config(train=train))


def demo_run(ctx: Context) -> dict:
    """Synthetic hidden shards, target head, draft vocab and target config at the demo's sizes
    (tests/support/synthetic_run.py, through bench/train.py), made once per check."""
    if "demo_run" not in ctx.cache:
        root = Path(tempfile.mkdtemp(prefix="demo_run-", dir=ctx.root))
        size = bench_train().SIZES["demo"]
        ctx.cache["demo_run"] = bench_train().write_synthetic_run(root, size, 48, shards=2)
    return ctx.cache["demo_run"]


# --- gpus -------------------------------------------------------------------------------------


def step_gpus(ctx: Context, figures: dict) -> None:
    """nvidia-smi's count is torch's; a claim locks a GPU that a second claim then cannot get."""
    from eaglenest.common.gpus import claim_gpus, visible_gpu_count

    figures["nvidia_smi_gpus"] = visible_gpu_count()
    figures["torch_gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ctx.cuda and "CUDA_VISIBLE_DEVICES" not in os.environ:
        check(figures, "count_mismatch", abs(figures["nvidia_smi_gpus"] - figures["torch_gpus"]), 0)
    total = max(1, figures["nvidia_smi_gpus"])  # no GPU here: the locks are tested all the same
    environ: dict[str, str] = {}
    first = claim_gpus(total, total=total, lock_dir=ctx.root / "locks", environ=environ)
    try:
        figures["claimed"] = environ.get("CUDA_VISIBLE_DEVICES")
        if first.indices != list(range(total)):
            raise CheckFailed(f"the first claim got {first.indices}, not all {total}")
        try:
            claim_gpus(1, total=total, lock_dir=ctx.root / "locks", environ={}, timeout_s=0)
        except TimeoutError:
            figures["second_claim"] = "refused"
        else:
            raise CheckFailed("a second claim got a GPU the first one holds")
    finally:
        first.release()
    again = claim_gpus(1, total=total, lock_dir=ctx.root / "locks", environ={}, timeout_s=0)
    figures["after_release"] = again.indices
    again.release()


# --- ttt --------------------------------------------------------------------------------------


def ttt_setup(s: dict) -> tuple[Eagle3Drafter, Batch]:
    """A random drafter (every EAGLE-3 variant on, as the schema's defaults) and a batch."""
    config = DrafterConfig(
        hidden_size=s["hidden"], target_hidden_size=s["hidden"], intermediate_size=s["mlp"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        vocab_size=s["vocab"], draft_vocab_size=s["draft"], aux_layer_ids=(2, 4, 6),
        max_position_embeddings=s["length"] + s["steps"], norm_before_fc=True, fc_norm=True,
        norm_before_residual=True, norm_output=True,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = Eagle3Drafter(config)
    with torch.no_grad():
        model.embed_tokens.weight.normal_(generator=generator)
        draft = torch.randperm(s["vocab"], generator=generator)[: s["draft"]].sort().values
        t2d = torch.zeros(s["vocab"], dtype=torch.bool)
        t2d[draft] = True
        model.set_vocab(draft - torch.arange(s["draft"]), t2d)
    b, t = s["batch"], s["length"]
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    loss_mask[0, t // 8 :] = True
    loss_mask[1, t // 4 : 3 * t // 4] = True
    batch = Batch(
        aux=torch.randn(b, t, 3 * s["hidden"], generator=generator),
        input_ids=torch.randint(0, s["vocab"], (b, t), generator=generator),
        loss_mask=loss_mask,
        target_logits=3 * torch.randn(b, t, s["draft"], generator=generator),
        in_draft_vocab=torch.rand(b, t, generator=generator) > 0.1,
        samples=[],
    )
    return model.train(), batch


def loss_and_grads(model, batch: Batch, steps: int, device: str, precision: str, segments=None,
                   processes: Processes | None = None, grads_of=None):  # fmt: skip
    """One TTT forward of `model` (the drafter or its DDP wrapper `model`, under train.autocast
    of `precision`), its loss (the schema's default objective and step weight) and the gradient
    of every parameter of `grads_of` (default: `model`)."""
    grads_of = grads_of or model
    grads_of.zero_grad(set_to_none=True)
    with autocast(device, precision):
        logits = ttt_forward(model, batch.aux, batch.input_ids, steps, segments=segments)
    loss, _ = ttt_loss(logits, batch, 0.8, processes)
    loss.backward()
    grads = {
        n: p.grad.detach().clone() for n, p in grads_of.named_parameters() if p.grad is not None
    }
    grads_of.zero_grad(set_to_none=True)
    return loss.detach(), grads


def grad_error(grads: dict, oracle: dict) -> tuple[float, str]:
    """The largest relative error of a gradient tensor, and its name."""
    errors = {name: rel_err(grads[name], g) for name, g in oracle.items()}
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def step_ttt(ctx: Context, figures: dict) -> None:
    s = TTT_SIZES[ctx.size]
    model, batch = ttt_setup(s)
    oracle_loss, oracle_grads = loss_and_grads(model, batch, s["steps"], "cpu", "fp32")
    on_device = copy.deepcopy(model).to(ctx.device)
    batch_device = batch.to(ctx.device)
    figures.update(T=s["length"], H=s["hidden"], ttt_steps=s["steps"])
    failures = []
    b, h, t = s["batch"], s["heads"], s["length"]
    saved = drafter_attention.LSE_CHUNK_SCORES
    runs = {"fp32": saved, "fp32_chunked": b * h * t * 16, "bf16": saved}
    for name, chunk_scores in runs.items():
        precision = "bf16" if name == "bf16" else "fp32"
        drafter_attention.LSE_CHUNK_SCORES = chunk_scores
        try:
            loss, grads = loss_and_grads(on_device, batch_device, s["steps"], ctx.device, precision)
        finally:
            drafter_attention.LSE_CHUNK_SCORES = saved
        grad, worst = grad_error(grads, oracle_grads)
        figures[f"worst_grad_{name}"] = worst
        for what, value in (("loss", rel_err(loss, oracle_loss)), ("grad", grad)):
            try:
                check(figures, f"{what}_rel_{name}", value, TOL[f"{precision}_{what}"])
            except CheckFailed as failure:
                failures.append(str(failure))
    try:
        lse_figures(ctx, s, figures)
    except CheckFailed as failure:
        failures.append(str(failure))
    if failures:
        raise CheckFailed("; ".join(failures))


def lse_figures(ctx: Context, s: dict, figures: dict) -> None:
    """The causal log-sum-exp under bf16 autocast is float32 and near the float64 one."""
    generator = torch.Generator().manual_seed(2)
    shape = (s["batch"], s["heads"], s["length"], s["head_dim"])
    q, k = (torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(2))
    scale = s["head_dim"] ** -0.5
    exact = causal_logsumexp(q, k, scale)
    with autocast(ctx.device, "bf16"):
        qd, kd = q.to(ctx.device, torch.bfloat16), k.to(ctx.device, torch.bfloat16)
        lse = causal_logsumexp(qd, kd, scale)
    figures["lse_dtype"] = str(lse.dtype).removeprefix("torch.")
    if lse.dtype != torch.float32:
        raise CheckFailed(f"the log-sum-exp under bf16 autocast is {lse.dtype}, not float32")
    # Its score matmuls run in bf16 (as autocast runs them): ~3e-4; a bf16 result would add 4e-3.
    check(figures, "lse_rel_bf16", rel_err(lse, exact), TOL["lse_bf16"])


# --- long context -----------------------------------------------------------------------------


def step_long_context(ctx: Context, figures: dict) -> None:
    """bench/train.py's long-context step at each T, one after the other in this process: on
    CUDA `max_memory_allocated` is reset for each, so each T's peak is its own."""
    lengths = LONG_CONTEXT_LENGTHS[ctx.size]
    step = bench_train().long_context_step
    sizes = bench_train().LONG_CONTEXT_SIZES["cuda" if ctx.cuda else "cpu"]
    figures["sizes"] = "/".join(f"{k}{v}" for k, v in sizes.items())
    step(lengths[0] // 2, ctx.device)  # warm-up: kernels and cuBLAS handles, not timed
    free_memory()
    rows, last_s = {}, 0.0
    for length in lengths:
        # The attention part grows as T^2: the next T takes up to 4x the last (doubling T).
        if last_s * (length / max(rows, default=length)) ** 2 > ctx.left_s():
            figures[f"T{length}"] = "skipped (budget)"
            continue
        row = None
        try:
            row = step(length, ctx.device)
        except torch.cuda.OutOfMemoryError:
            pass  # freed below, once the exception no longer holds the step's tensors
        free_memory()
        if row is None:
            figures[f"T{length}"] = "out of memory"
            continue
        rows[length], last_s = row, row["seconds"]
        figures[f"T{length}_peak_mib"] = round(row["peak_mib"])
        figures[f"T{length}_tokens_per_s"] = round(row["tokens_per_s"])
    if len(rows) < len(lengths):
        raise CheckFailed(f"only T = {sorted(rows)} ran of {list(lengths)}")
    long, quarter = lengths[-1], lengths[-1] // 4
    if quarter in rows:
        ratio = rows[long]["peak_mib"] / rows[quarter]["peak_mib"]
        if ctx.cuda:
            check(figures, f"peak_ratio_{long}_to_{quarter}", ratio, TOL["long_context_ratio"])
        else:  # resident memory of one process over several T: not each T's own peak
            figures[f"peak_ratio_{long}_to_{quarter}_cpu_resident"] = ratio


# --- packed -----------------------------------------------------------------------------------


def packed_setup(ctx: Context):
    """The demo drafter (train.build_drafter) and the first packed batch of the synthetic run that
    shares rows, with the same samples one to a row."""
    from transformers import AutoConfig

    from eaglenest.drafter.batches import build_packed_batch, open_shards
    from eaglenest.formats.draft_vocab import DraftVocab
    from eaglenest.formats.target_head import TargetHead
    from eaglenest.stages.train.initialise import build_drafter

    run = demo_run(ctx)
    head, vocab = TargetHead.load(run["target_head"]), DraftVocab.load(run["draft_vocab"])
    shards = open_shards(run["train_shards"], head, vocab)
    settings = train_settings(device=ctx.device)
    model = build_drafter(AutoConfig.from_pretrained(run["target_path"]), head, vocab, settings)
    plan = BatchPlan(shards, 1024, seed=0, packed=True)
    signal = TargetSignal(head, vocab, ctx.device)
    for refs in plan.epoch_order(0):
        packed = build_packed_batch(refs, shards, plan.max_batch_tokens)
        if packed.segments is not None:
            alone = signal.fill(build_batch(refs, shards).to(ctx.device))
            return model.to(ctx.device).train(), signal.fill(packed.to(ctx.device)), alone
    raise CheckFailed("no batch of the synthetic run packs several samples a row")


def step_packed(ctx: Context, figures: dict) -> None:
    model, packed, alone = packed_setup(ctx)
    steps = 7
    rows, width = packed.input_ids.shape
    figures.update(rows=rows, width=width, samples=len(packed.samples))
    failures = []
    for precision in ("fp32", "bf16"):
        ref_loss, ref_grads = loss_and_grads(model, alone, steps, ctx.device, precision)
        dense = loss_and_grads(model, packed, steps, ctx.device, precision, packed.segments)
        saved = drafter_attention.DENSE_PACKED_SCORES
        drafter_attention.DENSE_PACKED_SCORES = 0  # the linear path
        try:
            linear = loss_and_grads(model, packed, steps, ctx.device, precision, packed.segments)
        finally:
            drafter_attention.DENSE_PACKED_SCORES = saved
        loss_tol = TOL["packed_loss"] if precision == "fp32" else TOL["bf16_loss"]
        grad_tol = TOL["packed_grad"] if precision == "fp32" else TOL["bf16_grad"]
        for path, (loss, grads) in (("dense", dense), ("linear", linear)):
            try:
                check(figures, f"{path}_loss_rel_{precision}", rel_err(loss, ref_loss), loss_tol)
                error, _ = grad_error(grads, ref_grads)
                check(figures, f"{path}_grad_rel_{precision}", error, grad_tol)
            except CheckFailed as failure:
                failures.append(str(failure))
        figures[f"loss_{precision}"] = float(ref_loss)
    if failures:
        raise CheckFailed("; ".join(failures))


# --- train ------------------------------------------------------------------------------------


def train_curve(ctx: Context, device: str, precision: str, name: str) -> tuple[list[float], dict]:
    """`train_drafter` on the synthetic run: the training loss at every step, and its report."""
    from eaglenest.stages.train.train import train_drafter

    settings = train_settings(
        max_steps=TRAIN_STEPS[ctx.size], epochs=1000, max_batch_tokens=1024, warmup_steps=2,
        lr=1e-3, checkpoint_every=10**9, log_every=1, device=device, precision=precision,
        export_dtype="float32", seed=0,
    )  # fmt: skip
    out = ctx.root / f"train_{name}"
    run = demo_run(ctx)
    arguments = {k: v for k, v in run.items() if k != "target_path"}
    report = train_drafter(
        **arguments,
        out_dir=out / "drafter",
        journal_dir=out / "journal",
        settings=settings.with_target_path(run["target_path"]),
    )
    lines = (out / "journal" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [row["loss"] for row in rows if row["split"] == "train"], report


def step_train(ctx: Context, figures: dict) -> None:
    oracle, cpu_report = train_curve(ctx, "cpu", "fp32", "cpu_fp32")
    figures.update(steps=len(oracle), loss_first=oracle[0], loss_last=oracle[-1])
    figures["cpu_tokens_per_s"] = round(cpu_report["tokens_per_s"])
    failures = []
    for precision in ("fp32", "bf16"):
        curve, report = train_curve(ctx, ctx.device, precision, f"device_{precision}")
        figures[f"{precision}_tokens_per_s"] = round(report["tokens_per_s"])
        worst = max(abs(a - b) / abs(b) for a, b in zip(curve, oracle, strict=True))
        try:
            check(figures, f"curve_rel_{precision}", worst, TOL[f"curve_{precision}"])
        except CheckFailed as failure:
            failures.append(str(failure))
    if failures:
        raise CheckFailed("; ".join(failures))


# --- capture ----------------------------------------------------------------------------------


def random_target(ctx: Context) -> Path:
    """A random Qwen3 target saved as a checkpoint folder (what `load_target` reads)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sizes = {k: v for k, v in CAPTURE_SIZES[ctx.size].items() if k != "lengths"}
    torch.manual_seed(0)
    path = ctx.root / "target"
    Qwen3ForCausalLM(Qwen3Config(**sizes)).save_pretrained(path)
    return path


def capture(path: Path, device: str, model_dtype: str, batch_ids, settings) -> dict:
    """The capture backend's forward over one right-padded batch, as extract_hidden_states runs it."""
    from eaglenest.stages.hidden_states.extract import AuxCapture, forward_batch
    from eaglenest.target_model.loading import default_aux_layer_ids, load_target

    model = load_target(path, device, model_dtype)
    hooks = AuxCapture(model, default_aux_layer_ids(model.config.num_hidden_layers))
    try:
        result = forward_batch(model, hooks, batch_ids, settings)
        topk = forward_batch(
            model, hooks, batch_ids, dataclasses.replace(settings, target_signal="topk")
        )
    finally:
        hooks.remove()
    del model
    free_memory()
    return {**result, "topk_ids": topk["topk_ids"], "topk_values": topk["topk_values"]}


def step_capture(ctx: Context, figures: dict) -> None:
    from eaglenest.settings.hidden_states import HiddenSettings

    path = random_target(ctx)
    sizes = CAPTURE_SIZES[ctx.size]
    rng = np.random.default_rng(0)
    batch_ids = [rng.integers(0, sizes["vocab_size"], n) for n in sizes["lengths"]]
    settings = HiddenSettings.from_config(schema_config(hidden={"top_k": 16}))
    oracle = capture(path, "cpu", "float32", batch_ids, settings)
    # Only the positions of each sample: what lies past a sample's end is padding.
    real = torch.zeros(oracle["aux"].shape[:2], dtype=torch.bool)
    for row, ids in enumerate(batch_ids):
        real[row, : len(ids)] = True
    figures.update(layers=sizes["num_hidden_layers"], H=sizes["hidden_size"])
    failures = []
    for model_dtype, precision in (("float32", "fp32"), ("bfloat16", "bf16")):
        found = capture(path, ctx.device, model_dtype, batch_ids, settings)
        for name in ("aux", "final_hidden", "topk_values"):
            error = rel_err(found[name][real], oracle[name][real])
            try:
                check(figures, f"{name}_rel_{precision}", error, TOL[f"capture_{precision}"])
            except CheckFailed as failure:
                failures.append(str(failure))
        same = (found["topk_ids"][real][:, :1] == oracle["topk_ids"][real][:, :1]).float().mean()
        figures[f"top1_agree_{precision}"] = float(same)
        if precision == "fp32" and float(same) < TOL["topk_agree_fp32"]:
            failures.append(f"top1_agree_fp32={float(same):.3f}, goal >= {TOL['topk_agree_fp32']}")
    if failures:
        raise CheckFailed("; ".join(failures))


# --- fp8 --------------------------------------------------------------------------------------


def fp8_features(tokens: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [T, 3H] whose three layer blocks differ in magnitude (as a target's layers do), and
    final [T, H]."""
    generator = torch.Generator().manual_seed(3)
    aux = torch.randn(tokens, 3, hidden, generator=generator)
    aux = aux * torch.tensor([0.5, 8.0, 60.0])[None, :, None]
    final = torch.randn(tokens, hidden, generator=generator) * 3
    return aux.reshape(tokens, 3 * hidden), final


def step_fp8(ctx: Context, figures: dict) -> None:
    from eaglenest.formats.hidden_shard import fp8_dequantize, fp8_quantize

    tokens, hidden = FP8_SIZES[ctx.size]
    aux, final = fp8_features(tokens, hidden)
    q_cpu, scale_cpu = fp8_quantize(aux, 3)
    q_dev, scale_dev = fp8_quantize(aux.to(ctx.device), 3)
    figures.update(tokens=tokens, H=hidden)
    same = (q_dev.cpu().view(torch.uint8) == q_cpu.view(torch.uint8)).float().mean()
    check(figures, "encoded_equal_share", float(same), TOL["fp8_equal_share"], at_most=False)
    check(figures, "scale_rel", rel_err(scale_dev, scale_cpu), 0.0)
    decoded_dev = fp8_dequantize(q_cpu.to(ctx.device), scale_cpu.to(ctx.device))
    decoded_cpu = fp8_dequantize(q_cpu, scale_cpu)
    check(figures, "decoded_rel", rel_err(decoded_dev, decoded_cpu), 1e-7)
    check(figures, "roundtrip_rel", rel_err(decoded_cpu, aux), TOL["fp8_roundtrip"])
    read = fp8_shard_roundtrip(ctx, aux.to(ctx.device), final.to(ctx.device))
    check(figures, "shard_aux_rel", rel_err(read["aux"], decoded_cpu), TOL["fp8_shard"])
    final_cpu = fp8_dequantize(*fp8_quantize(final, 1))
    check(figures, "shard_final_rel", rel_err(read["final_hidden"], final_cpu), TOL["fp8_shard"])


def fp8_shard_roundtrip(ctx: Context, aux: torch.Tensor, final: torch.Tensor) -> dict:
    """A fp8 hidden shard of two samples written from device tensors, read back and decoded on
    the device (its stored fp8 values and scales moved there)."""
    from safetensors import safe_open

    from eaglenest.formats import hidden_shard
    from eaglenest.settings.hidden_states import HiddenSettings

    settings = HiddenSettings.from_config(schema_config(hidden={"dtype": "fp8"}))
    fp8_dequantize = hidden_shard.fp8_dequantize
    tokens, hidden = final.shape
    offsets = torch.tensor([0, tokens // 3, tokens])
    metadata = {"format": hidden_shard.FORMAT, "aux_layer_ids": "[2, 4, 6]", "hidden_size": str(hidden),
                "dtype": "fp8", "target_signal": "final_hidden", "sample_ids": '["a", "b"]'}  # fmt: skip
    specs = hidden_shard.tensor_specs(2, tokens, hidden, 3, settings)
    path = ctx.root / "fp8.safetensors"
    with hidden_shard.create_hidden_shard(path, specs, metadata, settings, 3) as writer:
        writer.write("offsets", 0, offsets)
        for first, last in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
            ids = torch.zeros(last - first, dtype=torch.long)
            mask = torch.ones(last - first, dtype=torch.uint8)
            signal = {"final_hidden": final[first:last]}
            writer.write_sample(first, aux[first:last], signal, ids, mask)
    shard = hidden_shard.open_hidden_shard(
        path, expect_layer_ids=[2, 4, 6], expect_hidden_size=hidden
    )
    with safe_open(str(path), framework="pt") as stored:
        decoded = {
            name: fp8_dequantize(
                stored.get_tensor(name).to(ctx.device),
                stored.get_tensor(f"{name}_scale").to(ctx.device),
            )
            for name in ("aux", "final_hidden")
        }
    on_cpu = torch.cat([shard.sample(0)["aux"], shard.sample(1)["aux"]])
    if rel_err(decoded["aux"], on_cpu) > 1e-7:
        raise CheckFailed("the shard's aux decoded on the device differs from HiddenShard.sample")
    return decoded


# --- ddp --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def step_ddp(ctx: Context, figures: dict) -> None:
    """The DDP step in a child process (a hung NCCL ends with the child, within the budget)."""
    spec = {"device": "cuda:0" if ctx.cuda else "cpu", "run": demo_run(ctx),
            "journal": str(ctx.root / "ddp_journal"), "port": free_port()}  # fmt: skip
    spec_path = ctx.root / "ddp.json"
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, str(Path(__file__).resolve()), "--ddp-child", str(spec_path),
               "--threads", str(torch.get_num_threads())]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(5, ctx.left_s()),
                              check=False)  # fmt: skip
    except subprocess.TimeoutExpired as expired:
        raise CheckFailed(f"the DDP child did not end in {expired.timeout:.0f} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise CheckFailed(f"the DDP child failed (exit {done.returncode}): {tail}")
    found = json.loads(lines[-1])
    figures.update({k: v for k, v in found.items() if not k.endswith("_rel")})
    check(figures, "grad_rel_to_2x", found["grad_rel_to_2x"], TOL["ddp"])
    check(figures, "step_loss_rel", found["step_loss_rel"], TOL["ddp"])


def ddp_child(spec: dict) -> dict:
    import torch.distributed as dist

    from eaglenest.stages.train.distributed import data_parallel
    from eaglenest.stages.train.feed import step_batches
    from eaglenest.stages.train.train import set_up_training

    device = spec["device"]
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec['port']}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        settings = train_settings(device=device, precision="fp32", max_batch_tokens=1024,
                                  checkpoint_every=10**9, max_steps=2)  # fmt: skip
        run = {k: v for k, v in spec["run"].items() if k not in ("eval_shards", "target_path")}
        training = set_up_training(
            **run, eval_shards=[], journal_dir=spec["journal"],
            settings=settings.with_target_path(spec["run"]["target_path"]),
        )  # fmt: skip
        one = Processes(device=device)
        _, _, raw = next(step_batches(training.plan, 0, 1, training.epoch_steps, one))
        batch = training.signal.fill(raw.to(device))
        model, steps, segments = training.model, settings.ttt_steps, batch.segments
        plain_loss, plain_grads = loss_and_grads(model, batch, steps, device, "fp32", segments)
        pretend = Processes(rank=0, world_size=2, device=device)
        wrapped = data_parallel(model, pretend)
        ddp_loss, ddp_grads = loss_and_grads(
            wrapped, batch, steps, device, "fp32", segments, processes=pretend, grads_of=model
        )
        grad_rel, _ = grad_error(ddp_grads, {n: 2 * g for n, g in plain_grads.items()})
        batches = step_batches(training.plan, 0, 1, training.epoch_steps, one)
        value = train_step_under(training, pretend, wrapped, batches)
        return {"backend": backend, "ddp": type(wrapped).__name__, "loss": float(plain_loss),
                "ddp_loss_over_plain": float(ddp_loss / plain_loss), "grad_rel_to_2x": grad_rel,
                "step_loss_rel": abs(value - float(plain_loss)) / abs(float(plain_loss))}  # fmt: skip
    finally:
        dist.destroy_process_group()


def train_step_under(training, processes: Processes, wrapped, batches) -> float:
    """train.train_step with `processes` (its all-reduces) through the DDP wrapper."""
    from eaglenest.stages.train.train import Progress, train_step

    pretend = dataclasses.replace(training, processes=processes)
    return train_step(pretend, wrapped, batches, Progress(step=0, started=time.perf_counter()))


# --- device_timings ---------------------------------------------------------------------------


def step_device_timings(ctx: Context, figures: dict) -> None:
    """bench/_device_timings.py on the device: the drafter/target forward-time ratio and the cost
    of verifying K + 1 tokens, at a few batch sizes, written as the file report.device.file
    reads (device_timings.json under $OUT, and --timings-json); the file must pass report.device's
    checks (settings/report.py), and the figures at batch 1 are the step's line."""
    from eaglenest.settings.report import device_timings

    path = BENCH_DIR / "_device_timings.py"
    spec = importlib.util.spec_from_file_location("gpu_check_timings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    timings = module.measure(ctx.device, ctx.size, deadline=ctx.deadline)
    out = os.environ.get("OUT")
    paths = [p for p in (ctx.timings_json, Path(out) / "device_timings.json" if out else None) if p]
    paths = paths or [ctx.root / "device_timings.json"]
    for each in paths:
        each.write_text(json.dumps(timings, indent=2) + "\n")
    by_batch = timings["device_timings"]["by_batch"]
    for batch, at in by_batch.items():
        figures[f"drafter_ratio_b{batch}"] = at["drafter_ratio"]
        figures[f"verify_cost_k3_b{batch}"] = at["verify_cost"].get("3")
    figures["target_step_ms_b1"] = 1000 * by_batch["1"]["target_step_s"]
    for batch in by_batch:  # what report.device reads of it, checked as a user's figures are
        device_timings({"file": str(paths[0]), "batch": int(batch)})


# --- vllm_mla_dflash ---------------------------------------------------------------------------


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses it (tests/bench/test_gpu_check.py)
        return False


def step_vllm_mla_dflash(ctx: Context, figures: dict) -> None:
    python = ctx.vllm_python
    if python is None and has_module("vllm"):
        python = sys.executable
    if python is None:
        raise StepSkipped("no vLLM here: --vllm-python PATH names a python that has it")
    spec = importlib.util.spec_from_file_location("gpu_vllm_mla", BENCH_DIR / "gpu_vllm_mla.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = Path(tempfile.mkdtemp(prefix="vllm_mla-", dir=ctx.root))
    # The budget is the GPU's; the CPU dry run (a refusal at engine start) may take longer.
    timeout_s = max(ctx.left_s(), 30.0) if ctx.cuda else 600.0
    figures.update(module.run(root, python, ctx.cuda, timeout_s=timeout_s))


# --- the runner -------------------------------------------------------------------------------


STEPS = {
    "gpus": step_gpus,
    "ttt": step_ttt,
    "long_context": step_long_context,
    "packed": step_packed,
    "train": step_train,
    "capture": step_capture,
    "fp8": step_fp8,
    "ddp": step_ddp,
    "device_timings": step_device_timings,
    "vllm_mla_dflash": step_vllm_mla_dflash,
}


def formatted(figures: dict) -> str:
    def value(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, (list, tuple)):
            return ",".join(value(x) for x in v)
        return str(v).replace(" ", "_")

    return " ".join(f"{k}={value(v)}" for k, v in figures.items())


class Report:
    """The lines and the JSON of the check, rewritten after every step."""

    def __init__(self, paths: list[Path], log_path: Path | None, meta: dict):
        self.paths, self.log_path = paths, log_path
        self.results: dict[str, Any] = {**meta, "steps": {}, "failed": []}
        self.started = time.perf_counter()
        if log_path:
            log_path.write_text("")

    def line(self, text: str) -> None:
        print(text, flush=True)
        if self.log_path:
            with self.log_path.open("a") as stream:
                stream.write(text + "\n")

    def step(self, name: str, record: dict) -> None:
        self.results["steps"][name] = record
        if record["status"] not in ("ok", "skip"):
            self.results["failed"].append(name)
        figures = {**record["figures"], "wall_s": record["wall_s"]}
        if record.get("error"):
            figures["error"] = record["error"]
        self.line(f"gpu-check {name} {record['status']} {formatted(figures)}")
        self.write()

    def write(self) -> None:
        self.results["wall_s"] = round(time.perf_counter() - self.started, 2)
        for path in self.paths:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(self.results, indent=2, default=str) + "\n")
            os.replace(tmp, path)


def run_step(name: str, ctx: Context) -> dict:
    started = time.perf_counter()
    ctx.deadline = started + BUDGET_S[name]
    record: dict[str, Any] = {"status": "ok", "figures": {}, "budget_s": BUDGET_S[name]}
    try:
        STEPS[name](ctx, record["figures"])  # fills the figures as it goes: kept on a failure
    except StepSkipped as reason:
        record["status"] = "skip"
        record["error"] = str(reason)
    except Exception as error:  # noqa: BLE001 (reported, and the next step runs)
        record["status"] = "FAIL"
        record["error"] = (
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        )
        if not isinstance(error, CheckFailed):
            record["traceback"] = traceback.format_exc(limit=8)
    finally:
        free_memory()
    record["wall_s"] = round(time.perf_counter() - started, 2)
    over = record["wall_s"] > BUDGET_S[name]
    # The budgets are the GPU's (its device time is rationed); the CPU dry run under a loaded
    # suite can pass one by a fraction of a second (packed: 20.24 s of 20), which says nothing
    # about the GPU: there it is noted, not failed.
    if over and ctx.cuda and record["status"] == "ok":
        record["status"] = "FAIL"
        record["error"] = f"over its budget of {BUDGET_S[name]} s"
    elif over:
        record["over_budget"] = True
    return record


def environment(device: str, small: bool) -> dict:
    import transformers

    env = {"device": device, "small": small, "torch": torch.__version__,
           "transformers": transformers.__version__, "python": sys.version.split()[0],
           "cuda_available": torch.cuda.is_available()}  # fmt: skip
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(cuda=torch.version.cuda, gpu=props.name, gpu_mib=props.total_memory // 2**20,
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32)  # fmt: skip
    return env


def output_paths(json_path: Path | None) -> tuple[list[Path], Path | None]:
    out = os.environ.get("OUT")
    paths = [json_path] if json_path else []
    log_path = None
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        paths.append(Path(out) / "gpu_check.json")
        log_path = Path(out) / "gpu_check.log"
    return paths, log_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="small sizes (the CPU test)")
    parser.add_argument("--only", nargs="+", choices=list(STEPS), metavar="STEP")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    parser.add_argument(
        "--timings-json", type=Path, help="device_timings: also write report.device's file here"
    )
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    parser.add_argument("--vllm-python", help="a python with vLLM (the vllm_mla_dflash step)")
    parser.add_argument("--ddp-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ddp_child:
        print(json.dumps(ddp_child(json.loads(args.ddp_child.read_text()))))
        return 0
    env = environment(args.device, args.small)
    paths, log_path = output_paths(args.json)
    report = Report(paths, log_path, {"env": env, "budget_s": BUDGET_S, "tolerances": TOL})
    usable = not args.device.startswith("cuda") or torch.cuda.is_available()
    report.line(f"gpu-check env {'ok' if usable else 'FAIL'} {formatted(env)}")
    if not usable:
        report.results["failed"].append("env")
        report.write()
        return 1
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ctx = Context(
            device=args.device,
            small=args.small,
            root=Path(tmp),
            timings_json=args.timings_json,
            vllm_python=args.vllm_python,
        )
        for name in args.only or STEPS:
            if time.perf_counter() - report.started > TOTAL_BUDGET_S:
                record = {"status": "FAIL", "figures": {}, "wall_s": 0.0,
                          "error": f"not run: the check's {TOTAL_BUDGET_S} s are spent"}  # fmt: skip
            else:
                record = run_step(name, ctx)
            report.step(name, record)
    failed = report.results["failed"]
    report.line(f"gpu-check done {'ok' if not failed else 'FAIL'} steps={len(args.only or STEPS)} "
                f"failed={','.join(failed) or 'none'} wall_s={report.results['wall_s']:.1f}")  # fmt: skip
    report.write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
