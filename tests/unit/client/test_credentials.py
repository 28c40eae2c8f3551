"""What no log or error may show (client/credentials.py): a URL's credentials in every form a
client sends them (the password, the query key's value, the Basic-auth header made of them), any
Authorization header a proxy echoes, and a key variable that is blank or empty named as such."""

from __future__ import annotations

import base64

import pytest

from eaglenest.client.credentials import (
    ApiKeyError,
    api_key_from_env,
    key_hint,
    redact,
    url_secrets,
)

URL = "http://alice:pw%21s3cret@gateway:8000/v1?key=qk-s3cret&model=m"


def test_a_urls_secrets_include_the_basic_auth_header_made_of_its_user_info():
    secrets = url_secrets(URL)
    assert {"pw!s3cret", "qk-s3cret", base64.b64encode(b"alice:pw!s3cret").decode()} <= set(secrets)
    assert "m" not in secrets  # a short value under another name: not blanked everywhere


@pytest.mark.parametrize(
    ("echoed", "secret"),
    [
        ("Authorization: Basic Zm9vOmJhcg==", "Zm9vOmJhcg=="),
        ("{'authorization': 'Bearer sk-live-0123456789'}", "sk-live-0123456789"),
        ('"Authorization": "Bearer abc.def.ghi"', "abc.def.ghi"),
        ("upstream refused: bearer tok-0123456789abc", "tok-0123456789abc"),
        ("GET https://bob:hunter22@proxy.internal/v1/models", "hunter22"),
        ("POST /v1/completions?model=m&api_key=AKIA123 HTTP/1.1", "AKIA123"),
        ("https://x/v1?token=t0k&x=1", "t0k"),
        ("/v1?access_token=at-99#frag", "at-99"),
    ],
)
def test_every_credential_form_a_proxy_echoes_is_redacted_whatever_its_value(echoed, secret):
    shown = redact(echoed, [])
    assert secret not in shown and "<redacted>" in shown


def test_plain_error_words_are_left_alone():
    text = "Bearer token required; Basic authentication failed; role user; model=m"
    assert redact(text, []) == text


def test_a_blank_key_variable_is_named_as_blank_not_unreachable(monkeypatch):
    monkeypatch.setenv("GEN_KEY", "  \t")
    with pytest.raises(ApiKeyError, match="GEN_KEY, which holds only blanks"):
        api_key_from_env("GEN_KEY")
    monkeypatch.delenv("GEN_KEY")
    with pytest.raises(ApiKeyError, match="GEN_KEY, which is not set"):
        api_key_from_env("GEN_KEY")


def test_an_empty_key_variable_sends_no_key_and_a_refusal_says_it_is_empty(monkeypatch):
    monkeypatch.setenv("GEN_KEY", "")
    assert api_key_from_env("GEN_KEY") == ""
    assert "names GEN_KEY, which is empty" in key_hint("GEN_KEY", "")
    assert "the key of GEN_KEY" in key_hint("GEN_KEY", "k")
    assert "names no variable" in key_hint(None, None)
