"""Credentials in an endpoint URL (user:password@, ?key=) reach no log, row or file of a
generation job, the slot directory included (real embedded server with faults)."""

from __future__ import annotations

import polars as pl
from support.frames import prompt_frame
from support.generation import MODEL, shard_settings

from eaglenest.common.config import validate_config
from eaglenest.common.io import write_json
from eaglenest.demo.server_process import running_server
from eaglenest.stages.generate.generate import (
    generate_shard,
)


def test_credentials_in_an_endpoint_url_reach_no_log_row_or_file(tmp_path, monkeypatch):
    from eaglenest.common.logs import log_to

    password, key = "s3cretpw-eaglenest", "k3yvalue-eaglenest"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the default slot dir, inside tmp_path
    prompts_path = tmp_path / "prompts.parquet"
    prompt_frame(6).write_parquet(prompts_path)
    probe = tmp_path / "probe.json"
    write_json(probe, {"token_ids": {"supported": True}})
    with running_server(model_name=MODEL, echo=True, faults={"error_500": 0.3}) as url:
        with_credentials = url.replace("http://", f"http://user:{password}@") + f"/v1?key={key}"
        config = validate_config(
            {
                "target": {"model": MODEL},
                "endpoints": [{"url": with_credentials}],
                "generation": {"backoff_base_s": 0.01, "activity_s": 0.1},
            }
        )
        with log_to(tmp_path / "generate.log"):
            result = generate_shard(
                prompts_path,
                probe,
                tmp_path / "raw.parquet",
                *shard_settings(config),
                tmp_path / "journal.jsonl",
                shard="00000",
                activity=tmp_path / "activity.json",
            )
    assert result == {"prompts": 6, "errors": 0}
    raw = pl.read_parquet(tmp_path / "raw.parquet")
    assert set(raw["endpoint"]) == {
        url.replace("http://", "http://<redacted>@") + "?key=<redacted>"
    }
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".url" for p in files)  # the slot directory was looked at too
    for path in files:
        data = path.read_bytes()
        assert password.encode() not in data and key.encode() not in data, path
