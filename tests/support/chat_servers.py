"""Chat-completion servers a test writes itself: an aiohttp app on 127.0.0.1 whose handler answers
what a broken server or proxy answers (malformed bodies, lone surrogates, endless error pages),
and the demo's echo answer for the prompts it answers well."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from eaglenest.demo.echo_backend import EchoBackend
from eaglenest.demo.protocol import build_response, parse_chat_request
from support.generation import MODEL


@contextlib.asynccontextmanager
async def serving(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """An HTTP server on 127.0.0.1 whose chat completions `handler` answers; yields its URL."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def echo_answer(body: dict) -> dict:
    """What the demo's echo server answers (vLLM's dialect, with token ids)."""
    completion = await EchoBackend().complete(parse_chat_request(body))
    return build_response(completion, model_name=MODEL, dialect="vllm", return_token_ids=True)


def last_user_text(body: dict) -> str:
    return body["messages"][-1]["content"]


def events(*chunks: bytes) -> bytes:
    """Server-sent events, one `data:` line a chunk."""
    return b"".join(b"data: " + chunk + b"\n\n" for chunk in chunks)


async def send_events(request: web.Request, payload: bytes) -> web.StreamResponse:
    """Answers `request` with `payload` as an event stream."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(payload)
    await response.write_eof()
    return response
