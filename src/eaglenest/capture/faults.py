"""What a capture server can answer wrongly, and what the capture pool (capture/pool.py) does
about each: the one place that sorts a server's answers.

- The server's fault (ServerFault): a 5xx or a retryable status (408, 500), an answer that is not
  the JSON of a completion, a state file lost, torn, hung or of the wrong shape (state_file.py,
  answer.py). The pool sets that server aside and sends the sample to another, at most MOVES_MAX
  times a sample.
- Overload (ServerBusy, a ServerFault): "busy, wait" (client/retry.py's BUSY_STATUS, the rule
  generation retries by too): 503 or 429 of a busy server, 502 or 504 of a gateway or ingress in
  front of a busy cluster. The server is not set aside but backed off (exponential with jitter,
  its `Retry-After` honoured up to a cap) and asked again; the sample's move counts only when
  another server served meanwhile: overload everywhere is waited for, within
  `vllm.capture_wait_s`, as servers that are down are.
- The request's or the run's fault (CaptureServerError, the job fails at once, naming server,
  sample and status): any other 4xx; 401 and 403 ("authentication": the key of
  `vllm.capture_key_env`); a server that serves another name; an answer naming a state file that
  is not this request's (the client reads and deletes only files named after its own request id,
  `cmpl-<id>-...safetensors`, whatever directory the server keeps them in: nothing else of a
  machine's can be read or removed through a server's answer).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from eaglenest.client.retry import BUSY_STATUS, RETRYABLE_STATUS

OVERLOAD_STATUS = BUSY_STATUS  # busy, not broken: backed off and asked again (ServerBusy)
OVERLOAD_NAMES = "/".join(map(str, sorted(OVERLOAD_STATUS)))  # as messages name them
AUTH_STATUS = (401, 403)  # refused credentials: no other server or try would take them
BODY_CHARS = 300  # of a server's answer, quoted in an error


class CaptureServerError(RuntimeError):
    """No capture server answers, one serves another capture, or one answered wrongly."""


class ServerFault(Exception):
    """What a server answered or wrote for a sample is unusable, through no fault of the
    request: the sample goes to another server. The message says what was wrong."""


class ServerBusy(ServerFault):
    """The server is overloaded (OVERLOAD_STATUS): it is backed off, not set aside, for at least
    `retry_after_s` (its `Retry-After`, when it gave one)."""

    def __init__(self, message: str, status: int, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after_s = status, retry_after_s


def authentication_error(server: str, status: int, key_env: str | None) -> CaptureServerError:
    if key_env:
        why = f"it refused the key of vllm.capture_key_env ({key_env})"
        fix = "start serve-capture and the jobs with the same key in that variable"
    else:
        why = "it demands a key and vllm.capture_key_env names none"
        fix = "set vllm.capture_key_env to the variable that holds the servers' key"
    return CaptureServerError(
        f"capture server {server}: authentication failed (HTTP {status}): {why}; {fix}"
    )


def status_fault(
    status: int,
    body: str,
    server: str,
    row: int,
    key_env: str | None,
    retry_after_s: float | None = None,
) -> ServerFault:
    """The fault of a completion answered with HTTP `status` (not 200): a ServerFault to move
    the sample (ServerBusy for overload, with the `Retry-After` it gave), or a
    CaptureServerError raised for what another server would refuse too."""
    if status in AUTH_STATUS:
        raise authentication_error(server, status, key_env)
    if status in OVERLOAD_STATUS:
        return ServerBusy(f"HTTP {status}: {body[:BODY_CHARS]}", status, retry_after_s)
    if status >= 500 or status in RETRYABLE_STATUS:
        return ServerFault(f"HTTP {status}: {body[:BODY_CHARS]}")
    raise CaptureServerError(
        f"sample row {row}: capture server {server} answered HTTP {status}, which no other "
        f"server would answer otherwise (the request's fault, not the server's): "
        f"{body[:BODY_CHARS]}"
    )


def served_models(status: int, body: str) -> list[str]:
    """The names a server's `/v1/models` answer lists; ServerFault for any answer that is not
    a model list (a server starting, another program on the port, garbage)."""
    if status != 200:
        raise ServerFault(f"/v1/models answered HTTP {status}: {body[:BODY_CHARS]}")
    try:
        models = json.loads(body)["data"]
        return [str(model["id"]) for model in models]
    except (ValueError, TypeError, KeyError) as err:
        raise ServerFault(
            f"/v1/models answered what is not a model list ({type(err).__name__}: {err}): "
            f"{body[:BODY_CHARS]!r}"
        ) from None


def completion(body: str) -> dict[str, Any]:
    """A completion's JSON answer; ServerFault when it is not a JSON object."""
    try:
        answer = json.loads(body)
    except ValueError as err:
        raise ServerFault(f"answered 200 with what is not JSON ({err}): {body[:BODY_CHARS]!r}")
    if not isinstance(answer, dict):
        raise ServerFault(f"answered 200 with JSON that is not an object: {body[:BODY_CHARS]!r}")
    return answer


def answered_path(answer: dict[str, Any], sent: np.ndarray, sent_id: str, who: str) -> str:
    """The state file of a completion answer, its prompt ids checked against those sent and its
    path against the request's name. ServerFault for a malformed answer; CaptureServerError
    (`who`: the sample and server) for a path that is not this request's file (never read, never
    deleted)."""
    try:
        choice = (answer.get("choices") or [{}])[0]
        returned = choice.get("prompt_token_ids")
        if returned is None:
            returned = answer.get("prompt_token_ids")
        returned = None if returned is None else list(returned)
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
    except (AttributeError, IndexError, KeyError, TypeError) as err:
        raise ServerFault(f"answered a malformed completion ({type(err).__name__}: {err})")
    if returned is not None and returned != sent.tolist():
        raise ServerFault(
            f"ran other prompt ids than were sent ({len(returned)} vs {len(sent)} tokens)"
        )
    if not path:
        raise ServerFault(
            "answered without kv_transfer_params.hidden_states_path: not a capture server "
            "(extract_hidden_states and a KV connector)"
        )
    if not own_state_file(str(path), sent_id):
        raise CaptureServerError(
            f"{who} named {str(path)!r} as the state file of request {sent_id}: not a file of that "
            f"request (an absolute path to cmpl-{sent_id}-...safetensors); refused, nothing "
            "read or deleted"
        )
    return str(path)


def own_state_file(path: str, sent_id: str) -> bool:
    """Whether `path` names a state file of request `sent_id` as vLLM names them
    (`<storage>/cmpl-<id>-<index>-<suffix>.safetensors`), absolute and with no `..`."""
    name = os.path.basename(path)
    return (
        os.path.isabs(path)
        and os.path.normpath(path) == path
        and name.startswith(f"cmpl-{sent_id}-")
        and name.endswith(".safetensors")
    )
