"""The capture servers' key: the one reader of the variable `vllm.capture_key_env` names, for
the pool that sends it (capture/pool.py) and for `eaglenest serve-capture`, which gives it to
vLLM (capture/server.py). One rule in both places, so a key the jobs send is the key the server
takes."""

from __future__ import annotations

import os

from eaglenest.capture.faults import CaptureServerError


class CaptureKeyError(CaptureServerError):
    """`vllm.capture_key_env` names a variable that holds no key; the message names it (the
    pool's callers report it as any capture failure; serve-capture as its own errors)."""


def capture_key(key_env: str | None, where: str = "the job's environment") -> str | None:
    """The key held by the environment variable `key_env` (`vllm.capture_key_env`); None when
    the config names no variable (the servers take no key).

    A named variable that is unset, empty or all blanks is an error naming the variable, never
    read as "no key": a server started without its key would take anyone's requests, and a job
    sending none (or `Bearer ` and blanks) would only be refused by every server. A key that
    holds characters is used exactly as set (no blanks trimmed): the pool sends, and vLLM is
    given, the same string. `where` names the environment in the message."""
    if not key_env:
        return None
    key = os.environ.get(key_env)
    if key is None or not key.strip():
        state = "not set" if key is None else "empty" if not key else "blank"
        raise CaptureKeyError(
            f"vllm.capture_key_env names the environment variable {key_env}, which is {state} "
            f"in {where}: export the capture servers' key in it (the key serve-capture was "
            "started with)"
        )
    return key
