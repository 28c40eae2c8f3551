"""The vLLM backend of the hidden-state stage (`hidden.backend: vllm`): the target runs in vLLM
itself, as users serve it (tensor parallel, quantized weights), and its states fill the shard that
plan.py lays out, the same `hidden/{shard}.safetensors` as the transformers backend writes.

vLLM runs in its own environment (`vllm.python`; its transformers pin differs from ours): either
as a child process of this job running vllm_engine/capture.py, the only module of ours it imports
besides the connector, or as the run's capture servers (`vllm.capture_urls`, capture_client.py).
Either writes one state file per request, `hidden_states` [T, 4, H] (the three aux layers and
layer N, the output of the last decoder layer *before* the final norm) and `token_ids` [T]; this
module packs each file as it comes and deletes it:
- `aux` [T, 3H]: layers 0-2 side by side: vLLM's layer id k is transformers' hidden_states[k],
  the same rows the transformers backend keeps;
- `final_hidden` [T, H]: the target's final norm (weights read by name from its checkpoint,
  RMSNorm as transformers computes it) applied to layer N; for `topk`, the LM head on that.
Every file's `token_ids` must equal the ids sent, or the job fails naming the sample.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from eaglenest.common.devices import resolve_device
from eaglenest.formats.hidden_shard import ShardWriter
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.hidden_states.plan import (
    TOPK_CHUNK_ROWS,
    ShardOutput,
    ShardPlan,
    finish_shard,
    open_shard,
    plan_hidden_shard,
    sample_rows,
)
from eaglenest.target_model.checkpoint import checkpoint_head_tensors
from eaglenest.target_model.files import resolve_target_dir
from eaglenest.target_model.loading import load_text_config
from eaglenest.vllm_engine.capture_request import VllmCaptureError, engine_request
from eaglenest.vllm_engine.process import (
    engine_messages,
    engine_process,
    engine_python,
    reply,
)

log = logging.getLogger(__name__)

CAPTURE_MODULE = "eaglenest.vllm_engine.capture"


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

    def __init__(self, writer: ShardWriter, plan: ShardPlan, signal: FinalSignal):
        self.writer, self.plan, self.signal = writer, plan, signal
        self.tokens = plan.tokens
        self._lock = threading.Lock()

    def __call__(self, i: int, path: str) -> None:
        states = read_request_file(path)  # waits on the file's .lock outside our own
        plan = self.plan
        with self._lock:
            pack_request(self.writer, plan.frame, i, plan.offsets, states, self.signal, self.tokens)


def capture_offline(
    request: dict, runtime: VllmRuntime, plan: ShardPlan, pack: RequestPacker
) -> float:
    """An engine of this job's own (vllm_engine/capture.py) over the shard, its files in a work folder
    beside the output that is removed however the job ends."""
    python = engine_python(runtime.python)
    work_dir = Path(request["out_dir"])
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    try:
        prompts = plan.frame["input_ids"].to_list()
        np.save(
            work_dir / "ids.npy", np.concatenate([np.asarray(x, dtype=np.int64) for x in prompts])
        )
        np.save(work_dir / "offsets.npy", plan.offsets)
        (work_dir / "request.json").write_text(json.dumps(request, indent=1))
        arguments = [str(work_dir / "request.json")]
        env = {"VLLM_CPU_KVCACHE_SPACE": str(runtime.cpu_kvcache_space_gb)}
        with engine_process(python, CAPTURE_MODULE, arguments, env) as process:
            return pack_as_they_come(process, len(plan.frame), pack)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def capture_through_server(
    request: dict, runtime: VllmRuntime, plan: ShardPlan, out: str | Path, pack: RequestPacker
) -> float:
    """The shard through the run's capture servers (`vllm.capture_urls`, capture_client.py)."""
    import asyncio

    from eaglenest.client.credentials import redacted_url
    from eaglenest.stages.hidden_states.capture_client import (
        CaptureJob,
        CaptureServerError,
        run_capture,
        shard_key,
    )
    from eaglenest.vllm_engine.capture_request import served_name

    job = CaptureJob(
        urls=list(runtime.capture_urls),
        model=served_name(request),
        prompts=[np.asarray(ids, dtype=np.int64) for ids in plan.frame["input_ids"].to_list()],
        pack=pack,
        cap=runtime.requests_per_batch,
        key=shard_key(out),
        wait_s=runtime.capture_wait_s,
        slots_dir=Path(runtime.slots_dir) if runtime.slots_dir else None,
    )
    n = len(plan.frame)
    names = ", ".join(redacted_url(url) for url in job.urls)
    log.info("capturing %d samples through %s (%s)", n, names, job.model)
    try:
        return asyncio.run(run_capture(job))
    except CaptureServerError as err:
        raise VllmCaptureError(f"{pack.tokens}: {err}") from err


def pack_as_they_come(process, n_samples: int, pack: RequestPacker) -> float:
    """Pack each request's file as the capture announces it, let it go on after each batch;
    returns the seconds vLLM spent generating. Fails, with the end of vLLM's log, unless every
    sample was packed and the capture said it was done."""
    from tqdm import tqdm

    tail: list[str] = []
    packed, generate_s = 0, None
    tokens = pack.tokens
    with tqdm(total=n_samples, desc=f"hidden {tokens.stem} (vllm)", file=sys.stderr) as bar:
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
    if generate_s is None or packed != n_samples:
        code = process.wait()
        raise VllmCaptureError(
            f"{tokens}: vLLM capture ended (exit code {code}) with {packed} of {n_samples} "
            "samples packed; end of its log:\n" + "\n".join(tail)
        )
    return generate_s


def capture_hidden_states_vllm(
    *,
    tokens: str | Path,
    out: str | Path,
    settings: HiddenSettings,
    runtime: VllmRuntime,
    summary_out: str | Path | None = None,
) -> dict[str, Any]:
    """Run the target (settings.target) in vLLM over a tokens shard and write its hidden-state
    shard; returns the summary."""
    started = time.perf_counter()
    target = settings.target
    trust_remote_code = target.trust_remote_code
    tokens, target_dir = Path(tokens), resolve_target_dir(target.path)
    model_config = load_text_config(target.path, trust_remote_code)  # Kimi-K2.5: text_config
    plan = plan_hidden_shard(tokens, model_config, settings)
    output = ShardOutput(out, summary_out, "vllm", target.path, target.model)
    signal = FinalSignal(target_dir, model_config, settings)
    request = engine_request(
        target_dir=target_dir,
        layer_ids=[*plan.layer_ids, model_config.num_hidden_layers],
        settings=settings,
        runtime=runtime,
        work_dir=Path(out).with_name(f".{Path(out).name}.vllm"),
        longest=int(plan.lengths.max(initial=0)),
        trust_remote_code=trust_remote_code,
    )
    with open_shard(output, plan, settings, settings.model_dtype) as writer:
        pack = RequestPacker(writer, plan, signal)
        if runtime.capture_urls:
            generate_s = capture_through_server(request, runtime, plan, out, pack)
        else:
            generate_s = capture_offline(request, runtime, plan, pack)
    return finish_shard(output, plan, settings, started, generate_s)
