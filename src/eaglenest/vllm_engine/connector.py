"""vLLM's hidden-states KV connector, made to run where the KV cache is in host memory (vLLM's CPU
build), for the vLLM backend of the hidden-state stage (vllm_engine/capture.py).

Runs inside vLLM's worker processes, under vLLM's interpreter (`make vllm`): it imports vLLM and
torch only. vLLM loads it by name (`kv_connector_module_path`).

vLLM's `ExampleHiddenStatesConnector` copies each finished request's states from the device with
a CUDA stream into pinned memory, then writes them from a thread. None of that exists on a CPU:
`pin_memory=True` raises ("requires a CUDA or other accelerator backend"). Here, when the cache is
on the CPU, the states are cut out of it with vLLM's own `extract_from_kv_cache` and written
before the step returns; on a GPU the reference path runs unchanged.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands for the CUDA event the reference polls: a CPU copy is complete when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        # clone: the cache's blocks are freed and reused once this request is reported done.
        states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file(
                {"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename
            )
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader's wait (flock)
        self._req_copy_events[pending.req_id] = _Done()
