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


def test_a_gateway_echoing_the_request_in_a_502_puts_no_credential_in_a_row_or_the_log(
    tmp_path, caplog
):
    """An ingress answers 502 with the request it got: its URL's query key and the Basic-auth
    header the client made of the URL's user info. The failure rows (and the log) show neither:
    the Basic form was not among the secrets redacted."""
    import asyncio
    import base64
    import logging

    from aiohttp import web
    from support.chat_servers import serving
    from support.generation import fast_settings

    from eaglenest.client.endpoints import Endpoint
    from eaglenest.stages.generate.generate import generate_records

    user, password, key = "gen-user", "pw-s3cret-gen", "qk-s3cret-gen"
    basic = base64.b64encode(f"{user}:{password}".encode()).decode()

    async def gateway(request: web.Request) -> web.Response:
        echoed = f"Authorization: {request.headers.get('Authorization')} {request.path_qs}"
        return web.Response(status=502, text=f"Bad Gateway; your request: {echoed}")

    async def scenario():
        async with serving(gateway) as url:
            secret_url = url.replace("http://", f"http://{user}:{password}@") + f"?key={key}"
            settings = fast_settings(max_attempts=2)
            return await generate_records(
                prompt_frame(2).to_dicts(), [Endpoint(secret_url)], settings, tmp_path / "j.jsonl"
            )

    with caplog.at_level(logging.INFO, logger="eaglenest"):
        records = asyncio.run(scenario())
    errors = [r["error"] for r in records.values()]
    assert all("HTTP" in e or "Bad Gateway" in e for e in errors), errors
    assert all("Authorization: Basic <redacted>" in e for e in errors), errors
    said = "\n".join(errors) + caplog.text + (tmp_path / "j.jsonl").read_text()
    for secret in (password, key, basic):
        assert secret not in said, secret


def test_a_blank_key_variable_fails_the_job_naming_it(tmp_path, monkeypatch):
    import asyncio

    import pytest
    from support.generation import fast_settings

    from eaglenest.client.credentials import ApiKeyError
    from eaglenest.client.endpoints import Endpoint
    from eaglenest.stages.generate.generate import generate_records

    monkeypatch.setenv("EAGLENEST_TEST_API_KEY", " \t ")
    endpoint = Endpoint("http://127.0.0.1:9", api_key_env="EAGLENEST_TEST_API_KEY")
    with pytest.raises(ApiKeyError, match=r"endpoints\[0\].api_key_env .* only blanks"):
        asyncio.run(
            generate_records(
                prompt_frame(1).to_dicts(), [endpoint], fast_settings(), tmp_path / "j"
            )
        )
