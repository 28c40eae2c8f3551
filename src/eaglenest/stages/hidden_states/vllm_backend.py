"""The vLLM backend of the hidden-state stage (`hidden.backend: vllm`): the target runs in vLLM
itself, as users serve it (tensor parallel, quantized weights), and its states fill the shard that
plan.py lays out, the same `hidden/{shard}.safetensors` as the transformers backend writes.

vLLM runs in its own environment (`vllm.python`; its transformers pin differs from ours): either
as a child process of this job running vllm_engine/capture.py, the only module of ours it imports
besides the connector, or as the run's capture servers (`vllm.capture_urls`, capture_client.py).
Either writes one state file per request, `hidden_states` [T, n + 1, H] (the n aux layers and
layer N, the output of the last decoder layer *before* the final norm) and `token_ids` [T]; this
module packs each file as it comes and deletes it:
- `aux` [T, n·H]: layers 0 to n-1 side by side: vLLM's layer id k is transformers' hidden_states[k],
  the same rows the transformers backend keeps;
- `final_hidden` [T, H]: the target's final norm (weights read by name from its checkpoint,
  RMSNorm as transformers computes it) applied to layer N; for `topk`, the LM head on that.
Every file's `token_ids` must equal the ids sent, or the job fails naming the sample.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from eaglenest.capture.answer import ExpectedStates, StateFileError, check_states, request_rows
from eaglenest.capture.final_signal import FinalSignal
from eaglenest.capture.request import VllmCaptureError, capture_engine_request
from eaglenest.capture.state_file import read_request_file
from eaglenest.formats.hidden_shard import ShardWriter
from eaglenest.settings.hidden_states import HiddenSettings
from eaglenest.settings.vllm import VllmRuntime
from eaglenest.stages.hidden_states.plan import (
    ShardOutput,
    ShardPlan,
    finish_shard,
    open_shard,
    plan_hidden_shard,
)
from eaglenest.target_model.files import resolve_target_dir
from eaglenest.target_model.loading import load_text_config
from eaglenest.vllm_engine.process import (
    engine_messages,
    engine_process,
    engine_python,
    reply,
)

log = logging.getLogger(__name__)

CAPTURE_MODULE = "eaglenest.vllm_engine.capture"


def pack_request(writer, frame, i: int, offsets, states, signal, tokens: Path) -> None:
    try:  # checked before anything is written
        rows = request_rows(frame, i, states, signal, tokens)
    except StateFileError as err:
        raise VllmCaptureError(str(err)) from err
    writer.write_sample(int(offsets[i]), *rows)


class RequestPacker:
    """Packs one request's state file into the shard and deletes it; callable from several
    threads at once (the server path reads files as their answers come). A file that is not
    what `expected` and the sample's ids call for raises StateFileError before anything is
    packed: the capture pool sends that sample to another server."""

    def __init__(
        self, writer: ShardWriter, plan: ShardPlan, signal: FinalSignal, expected: ExpectedStates
    ):
        self.writer, self.plan, self.signal, self.expected = writer, plan, signal, expected
        self.tokens = plan.tokens
        self._lock = threading.Lock()

    def __call__(self, i: int, path: str) -> None:
        states = read_request_file(path)  # waits on the file's .lock outside our own
        plan = self.plan
        check_states(states, self.expected, plan.frame["input_ids"][i].to_numpy(), path)
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

    from eaglenest.capture.request import served_name
    from eaglenest.capture.state_file import job_key
    from eaglenest.settings.urls import redacted_url
    from eaglenest.stages.hidden_states.capture_client import (
        CaptureJob,
        CaptureServerError,
        run_capture,
    )

    job = CaptureJob(
        urls=list(runtime.capture_urls),
        model=served_name(request),
        prompts=[np.asarray(ids, dtype=np.int64) for ids in plan.frame["input_ids"].to_list()],
        pack=pack,
        cap=runtime.requests_per_batch,
        key=job_key(out),
        wait_s=runtime.capture_wait_s,
        request_timeout_s=runtime.capture_request_timeout_s,
        lock_wait_s=runtime.capture_lock_wait_s,
        moves_max=runtime.capture_moves_max,
        slots_dir=Path(runtime.slots_dir) if runtime.slots_dir else None,
        key_env=runtime.capture_key_env,
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
    request = capture_engine_request(
        target_dir=target_dir,
        layer_ids=[*plan.layer_ids, model_config.num_hidden_layers],
        settings=settings,
        runtime=runtime,
        work_dir=Path(out).with_name(f".{Path(out).name}.vllm"),
        longest=int(plan.lengths.max(initial=0)),
        trust_remote_code=trust_remote_code,
    )
    with open_shard(output, plan, settings, settings.model_dtype) as writer:
        expected = ExpectedStates.of(
            len(plan.layer_ids) + 1,
            model_config.hidden_size,
            settings.model_dtype,
            settings.engine.engine_args if settings.engine else {},
        )
        pack = RequestPacker(writer, plan, signal, expected)
        if runtime.capture_urls:
            generate_s = capture_through_server(request, runtime, plan, out, pack)
        else:
            generate_s = capture_offline(request, runtime, plan, pack)
    return finish_shard(output, plan, settings, started, generate_s)
