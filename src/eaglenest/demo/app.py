"""The aiohttp app of `eaglenest serve`: its routes, fault injection and streaming.

`POST /v1/chat/completions` parses the request (protocol.py), asks the backend for a completion
and answers in the server's dialect; with `"stream": true` the same body is sent as server-sent
events, in the dialect's chunks (sse.py). Faults (errors, 429, hangs, broken bodies, dropped
connections, answers that lost the reasoning or carry malformed token ids) are injected at seeded
per-request rates (see faults.py) and counted at `GET /stats`, with the requests in flight now
and at most; `GET /metrics` shows vLLM's running and waiting gauges.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from eaglenest.demo.faults import ANSWER_FAULTS, FaultConfig, FaultInjector
from eaglenest.demo.protocol import (
    DIALECTS,
    Backend,
    ChatRequest,
    RequestError,
    build_response,
    parse_chat_request,
)
from eaglenest.demo.sse import event, stream_chunks

# A 200 whose JSON body is cut off mid-string, as a proxy that dropped the tail would send.
MALFORMED_BODY = (
    '{"id": "chatcmpl-malformed", "object": "chat.completion", "choices": '
    '[{"index": 0, "message": {"role": "assistant", "content": "\\n\\nThe ans'
)


def error_response(
    status: int, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None
) -> web.Response:
    error_type = {
        400: "BadRequestError",
        404: "NotFoundError",
        429: "RateLimitError",
        500: "InternalServerError",
    }.get(status, "Error")
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


@dataclass
class ServerState:
    backend: Backend
    model_name: str
    dialect: str
    faults: FaultInjector
    token_ids: bool = True  # False: ignore return_token_ids, like servers that predate it
    responses_ok: int = 0
    # Chat requests being handled now and the most at once: what a client's cap must bound.
    in_flight: int = 0
    max_in_flight: int = 0


STATE = web.AppKey("state", ServerState)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "eaglenest"}
    return web.json_response({"object": "list", "data": [model]})


async def stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        {
            "requests_total": state.faults.requests_total,
            "responses_ok": state.responses_ok,
            "in_flight": state.in_flight,
            "max_in_flight": state.max_in_flight,
            "faults": state.faults.counts,
            "fault_rates": dict(state.faults.config.rates),
            "fault_seed": state.faults.config.seed,
            "hang_s": state.faults.config.hang_s,
            "retry_after_s": state.faults.config.retry_after_s,
            "backend": state.backend.stats(),
        }
    )


async def metrics(request: web.Request) -> web.Response:
    """The two gauges of vLLM's Prometheus metrics a client reads to see the server's queue."""
    state = request.app[STATE]
    labels = f'{{model_name="{state.model_name}"}}'
    text = (
        f"# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{labels} {state.in_flight - state.backend.waiting()}\n"
        f"# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{labels} {state.backend.waiting()}\n"
    )
    return web.Response(text=text, content_type="text/plain")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        return await _chat_completion(request, state)
    finally:
        state.in_flight -= 1


async def _chat_completion(request: web.Request, state: ServerState) -> web.StreamResponse:
    fault = state.faults.draw()
    try:
        # Read the body now: after an injected hang the client may be gone, and its body with it.
        raw_body = await request.read()
    except ConnectionError:
        return _nobody_to_answer()
    if fault is not None and fault not in ANSWER_FAULTS:
        early = await _serve_fault(request, fault, state.faults.config)
        if early is not None:
            return early
    try:
        body = json.loads(raw_body)
    except ValueError as error:
        return error_response(400, f"the request body is not valid JSON: {error}")
    try:
        chat = parse_chat_request(body)
        if chat.model is not None and chat.model != state.model_name:
            raise RequestError(
                f"The model `{chat.model}` does not exist; this server serves "
                f"`{state.model_name}`.",
                param="model",
                status=404,
            )
        completion = await state.backend.complete(chat, paced=chat.stream)
    except RequestError as error:
        return error_response(error.status, error.message, param=error.param)
    except RuntimeError as error:
        return error_response(500, str(error))
    response = build_response(
        completion,
        model_name=state.model_name,
        dialect=state.dialect,
        return_token_ids=chat.return_token_ids and state.token_ids,
        drop_reasoning=fault == "drop_reasoning",
        bad_token_ids=fault == "bad_token_ids",
    )
    if chat.stream:
        return await _stream(request, state, chat, response, completion.pace_s, fault)
    if fault == "stall_stream":  # a request that cannot stall mid-stream hangs instead
        await asyncio.sleep(state.faults.config.hang_s)
        if _client_gone(request):
            return _nobody_to_answer()
    state.responses_ok += 1
    return web.json_response(response)


async def _stream(
    request: web.Request,
    state: ServerState,
    chat: ChatRequest,
    response: dict[str, Any],
    pace_s: float,
    fault: str | None,
) -> web.StreamResponse:
    """Send `response` as server-sent events, spread over `pace_s`; `stall_stream` stops sending
    after the first chunks and holds the connection open for hang_s, as a stuck engine does."""
    chunks = stream_chunks(response, dialect=state.dialect, include_usage=chat.include_usage)
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await stream.prepare(request)
    pause_s = pace_s / max(1, len(chunks) - 1)
    try:
        for index, chunk in enumerate(chunks):
            if fault == "stall_stream" and index == 2:
                await asyncio.sleep(state.faults.config.hang_s)
                return stream
            await stream.write(event(chunk))
            if pause_s > 0:
                await asyncio.sleep(pause_s)
        await stream.write(event("[DONE]"))
        await stream.write_eof()
    except ConnectionError:  # the client went away mid-stream
        return stream
    state.responses_ok += 1
    return stream


def _nobody_to_answer() -> web.Response:
    # aiohttp never writes a response to a closed connection; this one only ends the handler.
    return web.Response(status=499, text="client gone")


def _client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def _serve_fault(
    request: web.Request, fault: str, config: FaultConfig
) -> web.StreamResponse | None:
    """Answer with `fault`, or return None to go on serving normally (after a hang)."""
    if fault == "error_500":
        return error_response(500, "injected fault: internal server error")
    if fault == "rate_limit_429":
        seconds = config.retry_after_s
        retry_after = str(int(seconds)) if float(seconds).is_integer() else f"{seconds:g}"
        return error_response(
            429, "injected fault: rate limit exceeded", headers={"Retry-After": retry_after}
        )
    if fault == "malformed":
        return web.Response(status=200, text=MALFORMED_BODY, content_type="application/json")
    if fault == "drop_connection":
        # Close the socket under aiohttp's feet: the client sees the connection end without any
        # response bytes.
        if request.transport is not None:
            request.transport.abort()
        return _nobody_to_answer()
    if fault == "hang":
        # Only this handler sleeps; other requests are served meanwhile. A client that is still
        # waiting after hang_s gets a normal answer.
        await asyncio.sleep(config.hang_s)
        return _nobody_to_answer() if _client_gone(request) else None
    raise ValueError(f"unknown fault mode {fault!r}")


def create_app(
    backend: Backend,
    *,
    model_name: str,
    dialect: str,
    faults: FaultConfig | None = None,
    token_ids: bool = True,
) -> web.Application:
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}; choose one of {', '.join(DIALECTS)}")
    app = web.Application(client_max_size=64 * 1024**2)  # long multi-turn prompts
    app[STATE] = ServerState(
        backend, model_name, dialect, FaultInjector(faults or FaultConfig()), token_ids
    )
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app
