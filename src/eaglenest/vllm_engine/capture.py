"""The engine side of the vLLM backend of the hidden-state stage: runs under vLLM's interpreter
(`make vllm`, or the `vllm.python` of the config), started by vllm_backend.py.

    python -m eaglenest.vllm_engine.capture <request.json>

The request names the target, the engine arguments, the layers to capture and a folder of token
ids (ids.npy, offsets.npy: sample i is ids[offsets[i]:offsets[i+1]]). Each sample is one prompt of
`max_tokens=1` through offline `vllm.LLM` with the `extract_hidden_states` speculative method;
our connector (vllm_engine/connector.py) writes one safetensors file per request into the folder.

Batches of `requests_per_batch`; after each, one line per request on stdout,
`EAGLENEST {"index": i, "path": ...}`, then a wait for a line on stdin before the next batch: the
packer deletes each file as it packs it, so at most one batch of files is ever on disk. vLLM logs
to stdout too; the packer keeps only the lines with the marker and logs the others.

Imports vLLM, torch, numpy and eaglenest.vllm_engine.process only (not the rest of eaglenest):
vLLM's environment has its own transformers.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from eaglenest.vllm_engine.process import llm_arguments, one_shot_llm, say, start_group_watchdog

CONNECTOR_MODULE = "eaglenest.vllm_engine.connector"
CONNECTOR_CLASS = "HostHiddenStatesConnector"
# How long the engine may take to write the states of requests it has answered: the reader's own
# bound on a state file's lock (capture/state_file.py LOCK_WAIT_S): a stuck engine ends here, said.
STATES_WRITTEN_S = 120.0


def capture_arguments(request: dict, out_dir: Path) -> dict:
    """The engine arguments of a capture, the same for the offline engine and the capture server
    (vllm_engine/serve.py): `kv_transfer_config` as a dict (vLLM's server takes it as JSON)."""
    return llm_arguments(
        request,
        # Both cut a request's captured states short or leave them incomplete (vLLM's docs of
        # extract_hidden_states; NVIDIA Model-Optimizer's dump script says the same).
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": request["layer_ids"]}
            },
        },
        kv_transfer_config={
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(out_dir)},
        },
    )


def capture_engine(request: dict, out_dir: Path):
    from vllm.config import KVTransferConfig

    args = capture_arguments(request, out_dir)
    args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    return one_shot_llm(args)


def write_finished_states(llm) -> None:
    """With the engine core in this process: steps it until its scheduler holds no finished
    request. The hidden-states connector only records a finished request's save
    (`request_finished`); the worker writes the file in the next step (`get_finished`). A spawned
    engine core's loop keeps stepping while such requests wait; `LLM.generate` in this process
    returns once the outputs are out, and without these steps the last requests' files were
    never written (their locks held: the packer's StateFileHung after 120 s). Bounded: an
    engine still holding finished requests after STATES_WRITTEN_S raises, naming how many."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)  # vLLM's InprocClient only
    deadline = time.monotonic() + STATES_WRITTEN_S
    while core is not None and core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"vLLM had not written the hidden states of {len(core.scheduler.requests)} "
                f"answered requests {STATES_WRITTEN_S:.0f} s after answering them"
            )
        client.get_output()


def main(request_path: str) -> None:
    start_group_watchdog()  # first, while no thread runs: vLLM's processes die with this one
    import numpy as np
    from vllm import SamplingParams

    request = json.loads(Path(request_path).read_text())
    out_dir = Path(request["out_dir"])
    ids = np.load(out_dir / "ids.npy")
    offsets = np.load(out_dir / "offsets.npy")
    started = time.perf_counter()
    llm = capture_engine(request, out_dir)
    say({"engine_ready_s": round(time.perf_counter() - started, 3)})
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    per_batch = request["requests_per_batch"]
    generate_s = 0.0
    for first in range(0, len(offsets) - 1, per_batch):
        indices = range(first, min(first + per_batch, len(offsets) - 1))
        prompts = [{"prompt_token_ids": ids[offsets[i] : offsets[i + 1]].tolist()} for i in indices]
        tick = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        write_finished_states(llm)
        generate_s += time.perf_counter() - tick
        for i, output in zip(indices, outputs, strict=True):
            say({"index": i, "path": output.kv_transfer_params["hidden_states_path"]})
        say({"batch_done": indices[-1]})
        if not sys.stdin.readline():
            return  # the packer is gone: nothing would read the files
    say({"done": True, "generate_s": round(generate_s, 3)})


if __name__ == "__main__":  # LLM(...) starts its workers with spawn
    main(sys.argv[1])
