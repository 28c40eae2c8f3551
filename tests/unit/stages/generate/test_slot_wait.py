"""The wait for an endpoint slot is not latency: it is recorded apart (real embedded server in
echo mode, cap 1, four prompts at once)."""

from __future__ import annotations

import asyncio

from support.frames import prompt_frame
from support.generation import MODEL, fast_settings

from eaglenest.client.endpoints import Endpoint
from eaglenest.demo.server_process import running_server
from eaglenest.stages.generate.generate import (
    generate_records,
)


def test_latency_excludes_the_wait_for_a_slot_which_is_recorded_apart(tmp_path):
    """Cap 1, four prompts at once, 0.5 s each: they queue for the one slot."""
    prompts = prompt_frame(4).to_dicts()
    settings = fast_settings(timeout_s=10.0, slots_dir=str(tmp_path / "slots"))
    with running_server(model_name=MODEL, echo=True, echo_latency_s=0.5) as url:
        records = asyncio.run(
            generate_records(
                prompts, [Endpoint(url, max_concurrency=1)], settings, tmp_path / "j.jsonl"
            )
        )
    assert all(0.45 <= r["latency_s"] < 1.0 for r in records.values()), records
    waits = sorted(r["slot_wait_s"] for r in records.values())
    assert waits[0] < 0.3 and waits[-1] >= 1.3, waits  # the last one waited for three others
