"""The offline capture's engine core in its process (vllm_engine/capture.py): after each batch it
steps the engine until the scheduler holds no finished request, whose states vLLM's connector
writes a step later; an engine that never lets them go ends with a message instead of a hang.
The engine here is a stand-in with vLLM's shape (InprocClient.engine_core.scheduler); the real
one: tests/engine/test_vllm_capture_backend.py (its states equal transformers')."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eaglenest.vllm_engine import capture


class Scheduler:
    def __init__(self, held: int, steps_to_write: int | None) -> None:
        self.requests = {f"r{i}": object() for i in range(held)}
        self.steps_to_write = steps_to_write  # None: never

    def has_requests(self) -> bool:
        return bool(self.requests)


class Client:
    """vLLM's InprocClient as write_finished_states uses it: each get_output is one step."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.engine_core = SimpleNamespace(scheduler=scheduler)
        self.steps = 0

    def get_output(self) -> None:
        self.steps += 1
        scheduler = self.engine_core.scheduler
        if scheduler.steps_to_write is not None and self.steps >= scheduler.steps_to_write:
            scheduler.requests.clear()


def llm_of(client) -> SimpleNamespace:
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))


def test_the_engine_steps_until_the_answered_requests_states_are_written():
    client = Client(Scheduler(held=3, steps_to_write=2))
    capture.write_finished_states(llm_of(client))
    assert client.steps == 2 and not client.engine_core.scheduler.requests
    spawned = SimpleNamespace(get_output=None)  # vLLM's MP client: its core steps on its own
    capture.write_finished_states(llm_of(spawned))


def test_an_engine_that_never_writes_them_ends_with_a_message(monkeypatch):
    monkeypatch.setattr(capture, "STATES_WRITTEN_S", 0.05)
    client = Client(Scheduler(held=2, steps_to_write=None))
    with pytest.raises(RuntimeError, match="had not written the hidden states of 2 answered"):
        capture.write_finished_states(llm_of(client))
