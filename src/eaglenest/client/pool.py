"""The endpoints of a generation job: a request slot under each endpoint's run-wide cap, the
least-loaded endpoint first, failing endpoints benched, and a record of how busy each one was.

The cap is held by `EndpointSlots` (one lock file per endpoint on the host), so every shard job
running at once shares it: when one job's last requests leave slots free, another job's prompts
take them. The activity record (in flight over time, what the server said it queued, busy
slot-seconds) goes to the job's log as it runs and to its activity file, which the report merges
over shards.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from eaglenest.client.endpoints import Endpoint
from eaglenest.client.slots import POLL_S, EndpointSlots
from eaglenest.settings.urls import check_distinct, endpoint_path

log = logging.getLogger(__name__)

# Gauges of the server's own scheduler in its Prometheus /metrics: (running, waiting) names.
SERVER_GAUGES = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
}
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+([-+0-9.eE]+|NaN)\s*$")


@dataclass
class EndpointState:
    endpoint: Endpoint
    slots: EndpointSlots
    in_flight: int = 0  # this job's requests holding a slot
    consecutive_failures: int = 0
    benched_until: float = 0.0
    busy_s: float = 0.0  # slot-seconds this job held
    attempts: int = 0
    has_metrics: bool = True  # until /metrics fails once
    # [unix time, slots in use by every job, this job's, server running, server waiting]
    samples: list[list[Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Slot:
    state: EndpointState
    index: int
    acquired_at: float


class EndpointPool:
    """Hands out request slots: the least-loaded endpoint with a free slot under its run-wide cap;
    an endpoint that keeps failing is benched for a while (unless every endpoint is, then the
    soonest back is used)."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        bench_after_failures: int,
        bench_s: float,
        slots_dir: Path | None = None,
    ):
        check_distinct([e.url for e in endpoints])
        self.states = [
            EndpointState(e, EndpointSlots(e.name, e.max_concurrency, slots_dir)) for e in endpoints
        ]
        self.bench_after_failures = bench_after_failures
        self.bench_s = bench_s
        self._scan = asyncio.Lock()  # one coroutine looks for a slot; the others queue behind it
        self._freed = asyncio.Event()
        self._wanting = 0  # coroutines in acquire

    def close(self) -> None:
        for state in self.states:
            state.slots.close()

    def _candidates(self) -> list[EndpointState]:
        now = time.monotonic()
        healthy = [s for s in self.states if s.benched_until <= now]
        if not healthy:
            healthy = [min(self.states, key=lambda s: s.benched_until)]
        return sorted(healthy, key=lambda s: s.in_flight / s.endpoint.max_concurrency)

    async def acquire(self) -> Slot:
        self._wanting += 1
        try:
            async with self._scan:
                return await self._scan_for_slot()
        finally:
            self._wanting -= 1
            if not self._wanting:  # nothing of this job waits: older-first no longer applies
                for state in self.states:
                    state.slots.set_waiting(False)

    async def _scan_for_slot(self) -> Slot:
        while True:
            candidates = self._candidates()
            for state in candidates:
                index = state.slots.try_acquire()
                if index is not None:
                    state.in_flight += 1
                    state.attempts += 1
                    return Slot(state, index, time.monotonic())
            # Waiting is marked only where this job would take a slot: a mark on a benched
            # endpoint would hold younger jobs back from it for nothing.
            wanted = {id(state) for state in candidates}
            for state in self.states:
                state.slots.set_waiting(id(state) in wanted)
            # Woken at once by this job's releases; other jobs' are seen by polling.
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass

    def release(self, slot: Slot, ok: bool) -> None:
        state = slot.state
        state.slots.release(slot.index)
        state.in_flight -= 1
        state.busy_s += time.monotonic() - slot.acquired_at
        if ok:
            state.consecutive_failures = 0
        else:
            state.consecutive_failures += 1
            if state.consecutive_failures >= self.bench_after_failures:
                state.benched_until = time.monotonic() + self.bench_s
                state.consecutive_failures = 0
                log.warning("endpoint %s benched for %.0f s", state.endpoint.name, self.bench_s)
        self._freed.set()


def parse_server_gauges(text: str) -> dict[str, float] | None:
    """(running, waiting) requests from a Prometheus /metrics page of vLLM or SGLang, summed over
    label sets; None when neither server's gauges are there."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match and match.group(2) != "NaN":
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
    for running, waiting in SERVER_GAUGES.values():
        if running in values or waiting in values:
            return {"running": values.get(running, 0.0), "waiting": values.get(waiting, 0.0)}
    return None


async def server_gauges(
    session: aiohttp.ClientSession, state: EndpointState, headers: dict
) -> dict[str, float] | None:
    if not state.has_metrics:
        return None
    try:
        async with session.get(
            endpoint_path(state.endpoint.url, "/metrics"),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=2.0),
        ) as response:
            gauges = parse_server_gauges(await response.text()) if response.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
        gauges = None
    state.has_metrics = gauges is not None
    return gauges


async def watch_activity(
    pool: EndpointPool,
    session: aiohttp.ClientSession,
    headers_by_url: dict[str, dict],
    interval_s: float,
    stop: asyncio.Event,
) -> None:
    """Every `interval_s` until `stop`: each endpoint's slots in use by all jobs and by this one,
    and the server's running and waiting requests when it publishes them; logged and kept."""
    while True:
        for state in pool.states:
            gauges = await server_gauges(session, state, headers_by_url[state.endpoint.url])
            in_use = state.slots.in_use()
            running = None if gauges is None else gauges["running"]
            waiting = None if gauges is None else gauges["waiting"]
            state.samples.append([round(time.time(), 3), in_use, state.in_flight, running, waiting])
            server = (
                "" if gauges is None else f"; server: {running:.0f} running, {waiting:.0f} waiting"
            )
            log.info(
                "endpoint %s: %d of %d slots in flight (this job %d)%s",
                state.endpoint.name,
                in_use,
                state.endpoint.max_concurrency,
                state.in_flight,
                server,
            )
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
            return
        except asyncio.TimeoutError:
            pass


def activity_summary(pool: EndpointPool, started_at: float, finished_at: float) -> dict[str, Any]:
    """What the job's activity file holds: per endpoint, this job's busy slot-seconds, its own
    utilisation of the cap over its wall time, and the samples taken while it ran."""
    wall_s = max(finished_at - started_at, 1e-9)
    endpoints = []
    for state in pool.states:
        cap = state.endpoint.max_concurrency
        endpoints.append(
            {
                "url": state.endpoint.name,
                "cap": cap,
                "attempts": state.attempts,
                "busy_s": round(state.busy_s, 3),
                "utilisation": round(state.busy_s / (cap * wall_s), 4),
                "samples": state.samples,
            }
        )
    return {"started_at": started_at, "finished_at": finished_at, "endpoints": endpoints}
