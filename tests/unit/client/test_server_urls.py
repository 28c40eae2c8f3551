"""Server URLs, of generation's endpoints and of the capture servers alike (settings/urls.py): an
http(s) scheme and a host are required, a URL without a scheme is refused naming its config key
(it used to pass, then fail a job as a bare client error, or make serve-capture bind
127.0.0.1:8765); scheme and host case, a trailing `/v1` and slashes are one server, so two
spellings of one server are refused, naming both."""

from __future__ import annotations

import pytest

from eaglenest.client.endpoints import open_endpoints
from eaglenest.common.config import ConfigError, settings_from_sections, validate_config
from eaglenest.settings.endpoints import EndpointSettings
from eaglenest.settings.urls import UrlError, check_config_urls, normalized_url
from eaglenest.settings.vllm import VllmRuntime


def test_one_server_has_one_spelling():
    for spelling in ("HTTP://Node-A:8000/v1/", "http://node-a:8000//", "http://NODE-A:8000/v1"):
        assert normalized_url(spelling, "k") == "http://node-a:8000"
    assert normalized_url("https://u:PassWord@H/api/v1?key=AbC#x", "k") == (
        "https://u:PassWord@h/api?key=AbC"  # credentials, path and query as written
    )
    assert normalized_url("http://[::1]:80/v1", "k") == "http://[::1]:80"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("localhost:8000", "'localhost:8000': it has no scheme: write http://localhost:8000"),
        ("10.0.0.5:8000/v1", "it has no scheme: write http://10.0.0.5:8000/v1"),
        ("ftp://h:21", "its scheme 'ftp' is not http or https"),
        ("http:///v1", "'http:///v1' names no host"),
        ("http://h:port", "Port could not be cast to integer"),
    ],
)
def test_a_url_without_scheme_or_host_is_refused_naming_its_config_key(url, why):
    # Refused by the config check, before any settings are read (or any job runs).
    with pytest.raises(ConfigError, match="config key 'vllm.capture_urls': ") as capture:
        settings_from_sections(VllmRuntime, vllm={"capture_urls": [url]})
    assert why in str(capture.value)
    with pytest.raises(ConfigError, match=r"config key 'endpoints\[0\].url': ") as endpoint:
        validate_config({"endpoints": [{"url": url}]})
    assert why in str(endpoint.value)


def test_capture_urls_are_normalised_and_two_spellings_of_one_server_refused():
    runtime = settings_from_sections(
        VllmRuntime,
        vllm={"capture_urls": ["HTTP://B:2/v1/", "http://a:1"], "capture_url": "http://A:1/"},
    )
    assert runtime.capture_urls == ("http://b:2", "http://a:1")  # capture_url: one of the list
    with pytest.raises(ConfigError) as failure:
        settings_from_sections(VllmRuntime, vllm={"capture_urls": ["http://h:1", "http://H:1/v1"]})
    assert str(failure.value).endswith(
        "config key 'vllm.capture_urls': 'http://h:1' and 'http://H:1/v1' are the same server; "
        "list it once"
    )


def test_the_config_check_refuses_bad_server_urls_before_any_job_runs():
    check_config_urls({"endpoints": [{"url": "http://h:1"}], "vllm": {"capture_url": "http://c:2"}})
    with pytest.raises(UrlError, match="'vllm.capture_url': 'c:2': it has no scheme"):
        check_config_urls({"vllm": {"capture_url": "c:2"}})
    with pytest.raises(ValueError, match=r"entries 0 \(http://h:1\) and 1 \(http://H:1/v1/\)"):
        check_config_urls({"endpoints": [{"url": "http://h:1"}, {"url": "HTTP://H:1/v1/"}]})
    # What every entry point runs (Snakemake's parse, `eaglenest plan`, serve-capture).
    with pytest.raises(ConfigError, match="'vllm.capture_urls': 'node7:8765': it has no scheme"):
        validate_config({"vllm": {"capture_urls": ["node7:8765"]}})


def test_generation_endpoints_are_sent_to_their_normalised_url():
    config = validate_config({"endpoints": [{"url": "HTTP://Gen-Node:8000/v1/"}]})
    with open_endpoints(EndpointSettings.from_config(config), None) as endpoints:
        assert [e.url for e in endpoints] == ["http://gen-node:8000"]
