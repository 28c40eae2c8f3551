"""Request ids that the capture server refuses: vLLM's hidden-states connector names each state
file after its request (`<storage>/cmpl-<id>-0.safetensors`) and creates the directories it
names, so an id with `/` or `..` would write outside the storage directory, wherever the server
may write. Ids are letters, digits and `._:-` only (the pool's are `eaglenest-<key>-<attempt>-<n>`).

`SafeRequestIds` is an ASGI middleware that vLLM's server loads by name (`--middleware`,
vllm_engine/serve.py): it answers 400 to a request whose JSON `request_id` or `X-Request-Id`
header is not such an id, before vLLM sees it. Stdlib only: it runs under vLLM's interpreter.
"""

from __future__ import annotations

import json
import re
from typing import Any

SAFE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
MIDDLEWARE = f"{__name__}.SafeRequestIds"


def unsafe_request_id(request_id: Any) -> str | None:
    """Why `request_id` may not name a state file, or None when it may (None: vLLM picks one)."""
    if request_id is None:
        return None
    if not isinstance(request_id, str) or not SAFE_ID.fullmatch(request_id):
        return (
            f"request id {str(request_id)[:80]!r}: only letters, digits and ._:- (1 to 200), "
            "since it names a file in the capture server's storage"
        )
    if ".." in request_id:
        return f"request id {request_id!r}: '..' could name a file outside the storage"
    return None


class SafeRequestIds:
    """ASGI middleware: 400 for a request whose id `unsafe_request_id` refuses."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        header_id = headers.get("x-request-id")
        problem = unsafe_request_id(header_id.decode("latin-1")) if header_id else None
        body, more = b"", True
        messages = []
        while more:  # the whole body, then handed on as it came
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            more = message.get("more_body", False) and message["type"] == "http.request"
        if problem is None:
            problem = unsafe_request_id(_body_request_id(body))
        if problem is not None:
            return await _refuse(send, problem)

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


def _body_request_id(body: bytes) -> Any:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None  # not JSON: vLLM answers it itself
    return parsed.get("request_id") if isinstance(parsed, dict) else None


async def _refuse(send: Any, problem: str) -> None:
    payload = json.dumps({"error": {"message": problem, "type": "BadRequestError", "code": 400}})
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": payload.encode()})
