"""The vLLM backend of the hidden-state stage (`hidden.backend: vllm`): the target runs in vLLM
itself, as users serve it (tensor parallel, quantized weights), and its states are packed into the
same `hidden/{shard}.safetensors` as the transformers backend writes.

vLLM runs in its own environment (`vllm.python`; its transformers pin differs from ours), as a
child process running vllm_capture.py, the only module of ours it imports besides the connector.
That process writes one file per request, `hidden_states` [T, 4, H] (the three aux layers and
layer N, the output of the last decoder layer *before* the final norm) and `token_ids` [T]; this
one packs each file as it comes and deletes it:
- `aux` [T, 3H]: layers 0-2 side by side: vLLM's layer id k is transformers' hidden_states[k],
  the same rows the transformers backend keeps;
- `final_hidden` [T, H]: the target's final norm (weights read by name from its checkpoint,
  RMSNorm as transformers computes it) applied to layer N; for `topk`, the LM head on that.
Every file's `token_ids` must equal the ids sent, or the job fails naming the sample.

`verify_backends` (`hidden.verify_samples: N`) checks this backend against the transformers one
before any shard is captured: the first N samples of the first shard by both, stored exactly
(fp32, the final hidden state), compared layer by layer. A drafter is served on the engine's
features; one trained on features that differ (a kernel bug, another rotary layout) loses
acceptance silently. Per layer: for each token |vLLM - transformers| / |transformers| over the
hidden size, the largest and the mean over tokens; above `hidden.verify_tolerance` the job
fails with them, else `hidden/verify.json` keeps them for the report.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from eaglenest.common.devices import resolve_device
from eaglenest.common.engine_process import (
    engine_messages,
    engine_process,
    engine_python,
    reply,
)
from eaglenest.common.io import sha256_file, write_json
from eaglenest.formats.hidden_shard import create_hidden_shard, open_hidden_shard
from eaglenest.settings.hidden import HiddenSettings, HiddenVerifySettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.hidden_states.engine_request import VllmCaptureError, engine_request
from eaglenest.stages.hidden_states.extract import (
    TOPK_CHUNK_ROWS,
    extract_hidden_states,
    plan_hidden_shard,
    sample_rows,
    shard_metadata,
    shard_summary,
)
from eaglenest.target.checkpoint import checkpoint_head_tensors
from eaglenest.target.files import resolve_target_dir
from eaglenest.target.loading import load_text_config

log = logging.getLogger(__name__)

CAPTURE_MODULE = "eaglenest.stages.hidden_states.vllm_capture"


class FinalSignal:
    """The target signal from layer N's states: the final norm, then the LM head for top-k.

    The LM head runs on `hidden.device` (auto: the first GPU when there is one): Kimi-K2.5's is
    163,840 x 7168, 2.3 GFLOP a token, hours of CPU time a shard. It moves there at the first
    sample, once vLLM holds its share of the GPU memory (vLLM checks the free memory as it
    starts; 2.3 GB fits in what its default gpu_memory_utilization leaves)."""

    def __init__(self, target_dir: Path, model_config, settings: HiddenSettings):
        tied = bool(getattr(model_config, "tie_word_embeddings", False))
        tensors, tied = checkpoint_head_tensors(target_dir, tied)
        self.norm = tensors["norm.weight"]
        self.eps = float(model_config.rms_norm_eps)
        self.settings = settings
        self.device = resolve_device(settings.device)
        if settings.target_signal == "topk":
            self.head = tensors["embed_tokens.weight" if tied else "lm_head.weight"]

    def rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        """As transformers' Llama/Qwen RMSNorm: in float32, cast back, then the weight."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm * h.to(x.dtype)

    def __call__(self, last_layer: torch.Tensor) -> dict[str, torch.Tensor]:
        final = self.rms_norm(last_layer)
        if self.settings.target_signal != "topk":
            return {"final_hidden": final}
        self.head = self.head.to(self.device)  # a no-op after the first sample
        values, ids = [], []
        for chunk in final.split(TOPK_CHUNK_ROWS):
            logits = chunk.to(self.device, self.head.dtype) @ self.head.T
            top = torch.topk(logits.float(), self.settings.top_k)
            values.append(top.values.cpu())
            ids.append(top.indices.to(torch.int32).cpu())
        return {"topk_ids": torch.cat(ids), "topk_values": torch.cat(values)}


def read_request_file(path: str) -> dict[str, torch.Tensor]:
    """One request's states once vLLM has finished writing them (it holds a lock until then),
    then the file and its lock are deleted."""
    lock = path + ".lock"
    with contextlib.suppress(FileNotFoundError), open(lock) as stream:
        fcntl.flock(stream, fcntl.LOCK_SH)
    states = load_file(path)
    for name in (path, lock):
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)
    return states


def pack_request(writer, frame, i: int, offsets, states, signal, tokens: Path) -> None:
    ids, mask = sample_rows(frame["input_ids"][i].to_numpy(), frame["prompt_len"][i])
    returned = states["token_ids"].to(torch.int64)
    if not torch.equal(returned, ids):
        same = min(len(returned), len(ids))
        differ = (returned[:same] != ids[:same]).nonzero()
        where = int(differ[0]) if len(differ) else same
        raise VllmCaptureError(
            f"{tokens}: sample {frame['id'][i]!r} (row {i}): vLLM returned states for other "
            f"tokens than were sent ({len(returned)} vs {len(ids)} tokens, first difference at "
            f"position {where})"
        )
    hidden = states["hidden_states"]  # [T, 4, H]: the aux layers, then layer N
    if hidden.shape[0] != len(ids):
        raise VllmCaptureError(
            f"{tokens}: sample {frame['id'][i]!r} (row {i}): vLLM's state file has "
            f"{hidden.shape[0]} rows for {len(ids)} tokens"
        )
    aux = hidden[:, :3, :].reshape(hidden.shape[0], -1)
    writer.write_sample(int(offsets[i]), aux, signal(hidden[:, 3, :]), ids, mask)


class RequestPacker:
    """Packs one request's state file into the shard and deletes it; callable from several
    threads at once (the server path reads files as their answers come)."""

    def __init__(self, writer, frame, offsets, signal, tokens: Path):
        self.writer, self.frame, self.offsets = writer, frame, offsets
        self.signal, self.tokens = signal, tokens
        self._lock = threading.Lock()

    def __call__(self, i: int, path: str) -> None:
        states = read_request_file(path)  # waits on the file's .lock outside our own
        with self._lock:
            pack_request(self.writer, self.frame, i, self.offsets, states, self.signal,
                         self.tokens)  # fmt: skip


def capture_offline(request: dict, runtime: VllmRuntime, frame, offsets, pack) -> float:
    """An engine of this job's own (vllm_capture.py) over the shard, its files in a work folder
    beside the output that is removed however the job ends."""
    python = engine_python(runtime.python)
    work_dir = Path(request["out_dir"])
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    try:
        ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in frame["input_ids"].to_list()])
        np.save(work_dir / "ids.npy", ids)
        np.save(work_dir / "offsets.npy", offsets)
        (work_dir / "request.json").write_text(json.dumps(request, indent=1))
        with engine_process(
            python, CAPTURE_MODULE, [str(work_dir / "request.json")],
            {"VLLM_CPU_KVCACHE_SPACE": str(runtime.cpu_kvcache_space_gb)},
        ) as process:  # fmt: skip
            return pack_as_they_come(process, frame, pack)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def capture_through_server(request: dict, runtime: VllmRuntime, frame, out, pack) -> float:
    """The shard through the run's capture server (`vllm.capture_url`, capture_client.py)."""
    import asyncio

    from eaglenest.client.credentials import redacted_url
    from eaglenest.stages.hidden_states.capture_client import (
        CaptureJob,
        CaptureServerError,
        run_capture,
        shard_key,
    )
    from eaglenest.stages.hidden_states.engine_request import served_name

    job = CaptureJob(
        url=runtime.capture_url, model=served_name(request),
        prompts=[np.asarray(ids, dtype=np.int64) for ids in frame["input_ids"].to_list()],
        pack=pack,
        cap=runtime.requests_per_batch, key=shard_key(out),
        slots_dir=Path(runtime.slots_dir) if runtime.slots_dir else None,
    )  # fmt: skip
    log.info("capturing %d samples through %s (%s)", len(frame), redacted_url(job.url), job.model)
    try:
        return asyncio.run(run_capture(job))
    except CaptureServerError as err:
        raise VllmCaptureError(f"{pack.tokens}: {err}") from err


def pack_as_they_come(process, frame, pack: RequestPacker) -> float:
    """Pack each request's file as the capture announces it, let it go on after each batch;
    returns the seconds vLLM spent generating. Fails, with the end of vLLM's log, unless every
    sample was packed and the capture said it was done."""
    from tqdm import tqdm

    tail: list[str] = []
    packed, generate_s = 0, None
    tokens = pack.tokens
    with tqdm(total=len(frame), desc=f"hidden {tokens.stem} (vllm)", file=sys.stderr) as bar:
        for message in engine_messages(process, tail):
            if "index" in message:
                pack(message["index"], message["path"])
                packed += 1
                bar.update()
            elif "batch_done" in message:
                reply(process)
            elif "done" in message:
                generate_s = message["generate_s"]
            elif "engine_ready_s" in message:
                log.info("vLLM engine ready after %.1f s", message["engine_ready_s"])
    if generate_s is None or packed != len(frame):
        code = process.wait()
        raise VllmCaptureError(
            f"{tokens}: vLLM capture ended (exit code {code}) with {packed} of {len(frame)} "
            "samples packed; end of its log:\n" + "\n".join(tail)
        )
    return generate_s


def capture_hidden_states_vllm(
    *,
    tokens: str | Path,
    target_path: str | Path,
    out: str | Path,
    settings: HiddenSettings,
    runtime: VllmRuntime,
    target_name: str = "",
    trust_remote_code: bool = False,
    summary_out: str | Path | None = None,
) -> dict[str, Any]:
    """Run the target in vLLM over a tokens shard and write its hidden-state shard."""
    started = time.perf_counter()
    tokens, target_dir = Path(tokens), resolve_target_dir(target_path)
    model_config = load_text_config(target_path, trust_remote_code)  # Kimi-K2.5: text_config
    plan = plan_hidden_shard(tokens, model_config, settings)
    frame, layer_ids, lengths, offsets = plan.frame, plan.layer_ids, plan.lengths, plan.offsets
    n_tokens, hidden_size, specs = plan.n_tokens, plan.hidden_size, plan.specs
    metadata = shard_metadata(
        model_config=model_config, backend="vllm", target_path=target_path,
        target_name=target_name, layer_ids=layer_ids, settings=settings,
        tokens_sha256=sha256_file(tokens), sample_ids=frame["id"].to_list(),
        model_dtype=settings.model_dtype,
    )  # fmt: skip
    signal = FinalSignal(target_dir, model_config, settings)
    request = engine_request(
        target_dir=target_dir, layer_ids=[*layer_ids, model_config.num_hidden_layers],
        settings=settings, runtime=runtime, work_dir=Path(out).with_name(f".{Path(out).name}.vllm"),
        longest=int(lengths.max(initial=0)), trust_remote_code=trust_remote_code,
    )  # fmt: skip
    with create_hidden_shard(out, specs, metadata, settings, len(layer_ids)) as writer:
        writer.write("offsets", 0, torch.from_numpy(offsets))
        pack = RequestPacker(writer, frame, offsets, signal, tokens)
        if runtime.capture_url:
            generate_s = capture_through_server(request, runtime, frame, out, pack)
        else:
            generate_s = capture_offline(request, runtime, frame, offsets, pack)
    return shard_summary(
        frame=frame, n_tokens=n_tokens, out=out, layer_ids=layer_ids, settings=settings,
        hidden_size=hidden_size, seconds=time.perf_counter() - started, forward_s=generate_s,
        backend="vllm", summary_out=summary_out,
    )  # fmt: skip


# --- the check against the transformers backend (hidden.verify_samples) ---------------------


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
    from eaglenest.formats.tokens import read_tokens  # polars: see extract.py

    frame = read_tokens(tokens).head(n)
    frame.write_parquet(out)
    return frame.height


def verify_backends(
    *,
    tokens: str | Path,
    target_path: str | Path,
    out: str | Path,
    settings: HiddenSettings,
    verify: HiddenVerifySettings,
    runtime: VllmRuntime,
    target_name: str = "",
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Capture the first `verify.samples` samples of `tokens` with both backends, write the
    per-layer figures to `out`, and fail above `verify.tolerance` (the figures stay in `out`'s
    place only when they pass; the error message carries them either way)."""
    exact = replace(settings, dtype="fp32", target_signal="final_hidden")
    shared = {"target_path": target_path, "target_name": target_name,
              "trust_remote_code": trust_remote_code}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="eaglenest-verify-") as work:
        work_dir = Path(work)
        subset = work_dir / "tokens.parquet"
        n = _first_samples(Path(tokens), verify.samples, subset)
        capture_hidden_states_vllm(
            tokens=subset, out=work_dir / "vllm.safetensors",
            settings=replace(exact, backend="vllm"), runtime=runtime, **shared,
        )  # fmt: skip
        extract_hidden_states(
            tokens=subset, out=work_dir / "transformers.safetensors",
            settings=replace(exact, backend="transformers", engine=None), **shared,
        )  # fmt: skip
        agreement = layer_agreement(
            open_hidden_shard(work_dir / "vllm.safetensors"),
            open_hidden_shard(work_dir / "transformers.safetensors"),
        )
    worst = max(figures["max_relative"] for figures in agreement.values())
    result = {
        "tokens": str(tokens), "samples": n, "model_dtype": settings.model_dtype,
        "tolerance": verify.tolerance, "largest": worst, "passed": worst <= verify.tolerance,
        "layers": agreement,
    }  # fmt: skip
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
