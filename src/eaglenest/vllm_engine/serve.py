"""The engine side of the capture server (`eaglenest serve-capture`, capture/server.py): vLLM's
OpenAI server with the `extract_hidden_states` method and our connector, under vLLM's interpreter.

    python -m eaglenest.vllm_engine.serve <request.json>

The request is the offline capture's (vllm_engine/capture.py) plus `host`, `port` and `served_name`; the
engine arguments come from the same `capture_arguments`, CPU fixes included, so a shard captured
through the server holds what the offline engine writes. They become the server's flags
(cpu.server_flags) and vLLM's own `main` runs in this process.

Imports what vllm_engine/capture.py imports: vLLM, and of ours process.py and cpu.py only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from eaglenest.vllm_engine.capture import capture_arguments
from eaglenest.vllm_engine.cpu import server_flags
from eaglenest.vllm_engine.process import start_group_watchdog, worker_in_engine_core
from eaglenest.vllm_engine.request_ids import MIDDLEWARE


def server_argv(request: dict) -> list[str]:
    args = capture_arguments(request, Path(request["out_dir"]))
    name = ["--served-model-name", request["served_name"]]
    address = ["--host", request["host"], "--port", str(request["port"])]
    # Request ids name state files: refused when they could escape the storage (request_ids.py).
    # The key, when there is one, is in VLLM_API_KEY (capture/supervisor.child_env), not here.
    guard = ["--middleware", MIDDLEWARE]
    return ["vllm-capture-server", *server_flags(args), *name, *address, *guard]


def main(request_path: str) -> None:
    start_group_watchdog()  # nothing vLLM starts outlives this process, kill -9 included
    request = json.loads(Path(request_path).read_text())
    sys.argv = server_argv(request)
    if worker_in_engine_core():  # the server's engine core stays a process of its own (AsyncLLM)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    print("vLLM capture server:", " ".join(sys.argv[1:]), flush=True)
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    serve()


if __name__ == "__main__":  # vLLM starts its engine processes with spawn
    main(sys.argv[1])
