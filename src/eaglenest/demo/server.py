"""`eaglenest serve`: an OpenAI-compatible chat-completions server for a local causal LM.

It serves any transformers model directory (or, with `--echo`, canned answers with no model) on
127.0.0.1 and speaks the dialects real servers speak, so the pipeline and its tests meet the same
shapes they meet in production:

    dialect  reasoning field              token ids (with "return_token_ids": true)
    vllm     message.reasoning            top-level prompt_token_ids, choices[i].token_ids
    sglang   message.reasoning_content    choices[i].prompt_token_ids, choices[i].response_token_ids
    none     inline <think>…</think> in message.content; ids as vllm

Completion token ids include the stop token (as vLLM returns them), so prompt ids + completion
ids decode to the rendered prompt followed by exactly what the model generated. With
`"stream": true` the same body is sent as server-sent events, in the dialect's chunks (sse.py).

Faults (errors, 429, hangs, broken bodies, dropped connections, answers that lost the reasoning
or carry malformed token ids) are injected at seeded per-request rates (see faults.py) and
counted at `GET /stats`, with the requests in flight now and at most; `GET /metrics` shows
vLLM's running and waiting gauges.
Generation runs in batches on an engine thread (see engine.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import re
import signal
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from eaglenest.client.reasoning import THINK_END, THINK_START, split_think
from eaglenest.demo.faults import (
    ANSWER_FAULTS,
    FAULT_MODES,
    FaultConfig,
    FaultInjector,
    parse_fault_specs,
)
from eaglenest.demo.sse import event, stream_chunks

log = logging.getLogger(__name__)

DIALECTS = ("vllm", "sglang", "none")
LISTENING_PREFIX = "eaglenest serve: listening on "  # server_process.py reads the port from it
GREEDY_TEMPERATURE = 1e-5  # below this, sample greedily (vLLM's threshold)
# A 200 whose JSON body is cut off mid-string, as a proxy that dropped the tail would send.
MALFORMED_BODY = (
    '{"id": "chatcmpl-malformed", "object": "chat.completion", "choices": '
    '[{"index": 0, "message": {"role": "assistant", "content": "\\n\\nThe ans'
)
# Completion "ids" of the bad_token_ids fault: a string, a float, a null, a negative and an id
# beyond any small vocabulary, as a broken server or proxy might send them.
MALFORMED_TOKEN_IDS = ["12", 7.5, None, -1, 999999]


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-style error response."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


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


# -- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    model: str | None
    max_tokens: int | None  # None: up to the context length (or the server's default)
    temperature: float | None  # None: the model's default (generation_config), else 1
    top_p: float | None
    seed: int | None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    return_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def _number(body: dict, key: str, *, low: float, high: float | None = None) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{key}' must be a number, got {value!r}", param=key)
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"'{key}' must be {bounds}, got {value!r}", param=key)
    return float(value)


def _integer(body: dict, key: str, *, low: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer, got {value!r}", param=key)
    if low is not None and value < low:
        raise RequestError(f"'{key}' must be >= {low}, got {value!r}", param=key)
    return value


def _message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(
            f"messages[{index}] must be an object with a string 'role'", param="messages"
        )
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        texts = [
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        ]
        message = {**message, "content": "".join(texts)}
    elif content is not None and not isinstance(content, str):
        raise RequestError(
            f"messages[{index}].content must be a string, a list of parts or null",
            param="messages",
        )
    return message


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a chat-completions body; raise RequestError naming the first problem."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    if body.get("n") not in (None, 1):
        raise RequestError("only n=1 is supported", param="n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    max_tokens = _integer(body, "max_completion_tokens", low=1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", low=1)
    seed = _integer(body, "seed")
    return ChatRequest(
        messages=[_message(i, m) for i, m in enumerate(messages)],
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", low=0.0),
        top_p=_number(body, "top_p", low=1e-9, high=1.0),
        seed=None if seed is None else seed % 2**64,  # torch generators take 64-bit seeds
        chat_template_kwargs=kwargs,
        return_token_ids=bool(body.get("return_token_ids")),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
    )


# -- completions and responses ----------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]  # includes the stop token when finish_reason is "stop"
    text: str  # generated text with special tokens kept, without the final stop token
    finish_reason: str  # "stop" or "length"
    # Seconds a streamed answer is spread over (the echo backend's latency, paid while streaming).
    pace_s: float = 0.0


class Backend(Protocol):
    async def complete(self, request: ChatRequest, *, paced: bool = False) -> Completion: ...

    def waiting(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...


def build_response(
    completion: Completion,
    *,
    model_name: str,
    dialect: str,
    return_token_ids: bool,
    drop_reasoning: bool = False,
    bad_token_ids: bool = False,
) -> dict[str, Any]:
    """The chat.completion body for `completion` in `dialect` (whitespace kept as generated)."""
    reasoning, content = split_think(completion.text)
    if drop_reasoning:
        # The bug this mode reproduces: a normal-looking answer whose reasoning is gone.
        reasoning, content = None, content or ""
    elif dialect == "none":
        reasoning, content = None, completion.text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if dialect == "vllm":
        message["reasoning"] = reasoning
    elif dialect == "sglang":
        message["reasoning_content"] = reasoning
    message["tool_calls"] = []
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": completion.finish_reason,
    }
    response: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(completion.prompt_token_ids),
            "completion_tokens": len(completion.completion_token_ids),
            "total_tokens": len(completion.prompt_token_ids) + len(completion.completion_token_ids),
        },
    }
    if return_token_ids or bad_token_ids:  # a broken server sends its bad ids unasked too
        completion_ids = MALFORMED_TOKEN_IDS if bad_token_ids else completion.completion_token_ids
        if dialect == "sglang":
            choice["prompt_token_ids"] = completion.prompt_token_ids
            choice["response_token_ids"] = completion_ids
        else:
            response["prompt_token_ids"] = completion.prompt_token_ids
            choice["token_ids"] = completion_ids
    return response


# -- echo backend -------------------------------------------------------------------------------

ECHO_REASONING = "\nLet me think about this.\n"
NO_THINK_SWITCH = "/no_think"
ECHO_STOP_TOKEN = "<|im_end|>"
# Echo mode has no tokenizer: ids 0-255 are UTF-8 bytes and these tokens follow, one id each,
# so ids stay consistent with the text (echo_decode(prompt ids + ids) is prompt + completion).
ECHO_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", ECHO_STOP_TOKEN, THINK_START, THINK_END)
_ECHO_SPECIAL_IDS = {token: 256 + i for i, token in enumerate(ECHO_SPECIAL_TOKENS)}
_ECHO_SPECIAL_PATTERN = re.compile("|".join(re.escape(t) for t in ECHO_SPECIAL_TOKENS))


def echo_encode(text: str) -> list[int]:
    ids: list[int] = []
    position = 0
    for match in _ECHO_SPECIAL_PATTERN.finditer(text):
        ids.extend(text[position : match.start()].encode())
        ids.append(_ECHO_SPECIAL_IDS[match.group()])
        position = match.end()
    ids.extend(text[position:].encode())
    return ids


def echo_decode(ids: list[int]) -> str:
    parts: list[str] = []
    pending = bytearray()
    for token_id in ids:
        if token_id < 256:
            pending.append(token_id)
            continue
        parts.append(pending.decode(errors="replace"))
        pending.clear()
        parts.append(ECHO_SPECIAL_TOKENS[token_id - 256])
    parts.append(pending.decode(errors="replace"))
    return "".join(parts)


def render_echo_prompt(messages: list[dict[str, Any]], enable_thinking: bool = True) -> str:
    """ChatML, like the demo target's template (with add_generation_prompt=True)."""
    turns = [f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages]
    prompt = "".join(turns) + "<|im_start|>assistant\n"
    return prompt if enable_thinking else prompt + "<think>\n\n</think>\n\n"


class EchoBackend:
    """Answers after a latency with canned reasoning and an echo of the last user turn.

    Benchmarks of HTTP clients run against it, so it does no work beyond string building. The
    latency is `latency_s`, or lognormal around that median with `latency_sigma` (as reasoning
    lengths are), drawn from the request's seed so each prompt always takes the same time.
    A streamed answer is paced: its chunks are spread over the latency instead of waiting first.
    """

    def __init__(self, latency_s: float = 0.0, latency_sigma: float = 0.0) -> None:
        self.latency_s = latency_s
        self.latency_sigma = latency_sigma
        self.completions = 0
        self._random = random.Random(0)

    def latency(self, request: ChatRequest) -> float:
        if self.latency_sigma <= 0:
            return self.latency_s
        draw = random.Random(request.seed) if request.seed is not None else self._random
        return self.latency_s * math.exp(self.latency_sigma * draw.gauss(0.0, 1.0))

    def waiting(self) -> int:
        return 0  # no queue: every request is answered at once

    async def complete(self, request: ChatRequest, *, paced: bool = False) -> Completion:
        latency = self.latency(request)
        if latency > 0 and not paced:
            await asyncio.sleep(latency)
        last_user = next(
            (m.get("content") or "" for m in reversed(request.messages) if m["role"] == "user"), ""
        )
        thinking = request.chat_template_kwargs.get("enable_thinking", True) is not False
        prompt = render_echo_prompt(request.messages, thinking)
        answer = "\n\n" + last_user
        # Qwen3's soft switch: a user turn ending in /no_think gets an empty think block, which is
        # how a real reasoning model skips thinking on one prompt.
        reasoning = "\n\n" if last_user.rstrip().endswith(NO_THINK_SWITCH) else ECHO_REASONING
        text = f"{THINK_START}{reasoning}{THINK_END}{answer}" if thinking else answer
        completion_ids = echo_encode(text + ECHO_STOP_TOKEN)
        finish_reason = "stop"
        if request.max_tokens is not None and len(completion_ids) > request.max_tokens:
            completion_ids = completion_ids[: request.max_tokens]
            text, finish_reason = echo_decode(completion_ids), "length"
        self.completions += 1
        return Completion(
            echo_encode(prompt), completion_ids, text, finish_reason, latency if paced else 0.0
        )

    def stats(self) -> dict[str, Any]:
        return {
            "backend": "echo",
            "latency_s": self.latency_s,
            "latency_sigma": self.latency_sigma,
            "completions": self.completions,
        }


# -- model backend ------------------------------------------------------------------------------


class ModelBackend:
    """A transformers causal LM behind a batching engine."""

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        trust_remote_code: bool = False,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 64,
        gather_window_s: float = 0.005,
        max_model_len: int | None = None,
        default_max_tokens: int | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from eaglenest.common.devices import resolve_device
        from eaglenest.demo.engine import BatchingEngine
        from eaglenest.target.files import resolve_target_dir

        # Local directories, or hub names resolved in the local cache (never downloaded here).
        model_dir = str(resolve_target_dir(model_path, "target.path"))
        tokenizer_dir = (
            str(resolve_target_dir(tokenizer_path, "target.tokenizer"))
            if tokenizer_path
            else model_dir
        )
        device = resolve_device(device)
        if dtype == "auto" and device == "cpu":
            dtype = "float32"  # half precision matmuls are slow (or missing) on many CPUs
        self.tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_dir, trust_remote_code=trust_remote_code
        )
        model = AutoModelForCausalLM.from_pretrained(
            model_dir,
            dtype=dtype if dtype == "auto" else getattr(torch, dtype),
            trust_remote_code=trust_remote_code,
        )
        model.to(device).eval()
        self.stop_token_ids = stop_token_ids(model.generation_config, self.tokenizer)
        pad_token_id = self.tokenizer.pad_token_id
        if pad_token_id is None:  # padded positions are masked: any id will do
            pad_token_id = min(self.stop_token_ids)
        self.max_model_len = max_model_len or getattr(model.config, "max_position_embeddings", None)
        self.sampling_defaults = _sampling_defaults(model.generation_config)
        self.default_max_tokens = int(
            default_max_tokens or self.sampling_defaults.get("max_new_tokens") or 4096
        )
        self.engine = BatchingEngine(
            model,
            self.stop_token_ids,
            pad_token_id,
            max_batch_size=max_batch_size,
            gather_window_s=gather_window_s,
        )
        log.info(
            "loaded %s on %s (%s); stop tokens %s; sampling defaults %s",
            model_path,
            device,
            model.dtype,
            sorted(self.stop_token_ids),
            self.sampling_defaults,
        )

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self.engine.stop()

    def render_prompt(self, request: ChatRequest) -> list[int]:
        import jinja2

        try:
            prompt = self.tokenizer.apply_chat_template(
                request.messages,
                tokenize=False,
                add_generation_prompt=True,
                **request.chat_template_kwargs,
            )
        # Template errors are the request's fault (roles, content types, kwargs).
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, AttributeError) as error:
            raise RequestError(f"the chat template failed on this request: {error}") from None
        # Like vLLM: the template already wrote every special token the prompt needs.
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def waiting(self) -> int:
        return self.engine.waiting()

    async def complete(self, request: ChatRequest, *, paced: bool = False) -> Completion:
        """The whole answer; a streamed one is then sent at once (the engine does not stream)."""
        from eaglenest.demo.engine import SamplingParams

        prompt_ids = self.render_prompt(request)
        params = SamplingParams(
            max_new_tokens=self._max_new_tokens(request, len(prompt_ids)),
            temperature=_first(request.temperature, self.sampling_defaults.get("temperature"), 1.0),
            top_p=_first(request.top_p, self.sampling_defaults.get("top_p"), 1.0),
            seed=request.seed,
        )
        if params.temperature < GREEDY_TEMPERATURE:
            params = SamplingParams(params.max_new_tokens, 0.0, 1.0, params.seed)
        result = await self.engine.generate(prompt_ids, params)
        generated = result.completion_token_ids
        text_ids = generated[:-1] if result.finish_reason == "stop" else generated
        text = self.tokenizer.decode(
            text_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return Completion(prompt_ids, generated, text, result.finish_reason)

    def _max_new_tokens(self, request: ChatRequest, prompt_len: int) -> int:
        if self.max_model_len is None:
            return request.max_tokens or self.default_max_tokens
        room = self.max_model_len - prompt_len
        if room < 1 or (request.max_tokens is not None and request.max_tokens > room):
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {prompt_len} and max_tokens is {request.max_tokens}",
                param="max_tokens",
            )
        return request.max_tokens or min(room, self.default_max_tokens)

    def stats(self) -> dict[str, Any]:
        engine = self.engine.stats
        return {
            "backend": "model",
            "batches": engine.batches,
            "completions": engine.requests,
            "generated_tokens": engine.generated_tokens,
            "max_batch_size_seen": engine.max_batch_size_seen,
        }


def stop_token_ids(generation_config: Any, tokenizer: Any) -> set[int]:
    """End-of-turn ids: generation_config's eos ids (chat models list <|im_end|> there) and the
    tokenizer's eos."""
    ids: set[int] = set()
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _sampling_defaults(generation_config: Any) -> dict[str, float]:
    # vLLM applies the sampling values a model ships in generation_config.json (max_new_tokens
    # becomes the default max_tokens); do the same.
    shipped = generation_config.to_diff_dict() if generation_config is not None else {}
    keys = ("temperature", "top_p", "max_new_tokens")
    return {k: float(shipped[k]) for k in keys if shipped.get(k) is not None}


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)


# -- the web app --------------------------------------------------------------------------------


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


# -- command line -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    what = parser.add_argument_group("what to serve")
    what.add_argument("--model-path", help="local transformers model directory")
    what.add_argument("--tokenizer", help="tokenizer directory (default: --model-path)")
    what.add_argument(
        "--served-model-name", help="name clients send as `model` (default: dir name)"
    )
    what.add_argument("--trust-remote-code", action="store_true")
    what.add_argument("--echo", action="store_true", help="no model: answer with canned text")
    what.add_argument(
        "--echo-latency-s", type=float, default=0.0, help="echo: seconds per answer (the median)"
    )
    what.add_argument(
        "--echo-latency-sigma",
        type=float,
        default=0.0,
        help="echo: lognormal spread of the latency (0: fixed; 1: like reasoning lengths)",
    )
    what.add_argument("--dialect", choices=DIALECTS, default="vllm")
    what.add_argument(
        "--no-token-ids",
        action="store_true",
        help="ignore return_token_ids (as servers that predate it do)",
    )
    where = parser.add_argument_group("where")
    where.add_argument("--host", default="127.0.0.1")
    where.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    where.add_argument("--access-log", action="store_true", help="log every request")
    # Set by server_process.running_server: exit when that process is gone.
    where.add_argument("--exit-with-parent", type=int, metavar="PID", help=argparse.SUPPRESS)
    how = parser.add_argument_group("generation")
    how.add_argument("--max-batch-size", type=int, default=64)
    how.add_argument(
        "--gather-window-s",
        type=float,
        default=0.005,
        help="how long the engine waits for more requests before starting a batch",
    )
    how.add_argument("--max-model-len", type=int, help="default: max_position_embeddings")
    how.add_argument(
        "--default-max-tokens",
        type=int,
        help="max_tokens of requests that send none (default: generation_config's "
        "max_new_tokens, else 4096; capped by the context)",
    )
    how.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    how.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    how.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    faults = parser.add_argument_group("fault injection")
    faults.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="MODE=RATE",
        help=f"repeatable; modes: {', '.join(FAULT_MODES)}",
    )
    faults.add_argument("--fault-seed", type=int, default=0)
    faults.add_argument("--hang-s", type=float, default=60.0)
    faults.add_argument("--retry-after-s", type=float, default=1.0)


def run(args: argparse.Namespace) -> int:
    if not args.echo and not args.model_path:
        raise SystemExit("eaglenest serve: give --model-path DIR, or --echo to serve without one")
    try:
        faults = FaultConfig(
            rates=parse_fault_specs(args.fault),
            seed=args.fault_seed,
            hang_s=args.hang_s,
            retry_after_s=args.retry_after_s,
        )
    except ValueError as error:
        raise SystemExit(f"eaglenest serve: {error}") from None
    model_name = args.served_model_name or (
        "echo" if args.echo else Path(args.model_path).resolve().name
    )
    backend: EchoBackend | ModelBackend
    if args.echo:
        backend = EchoBackend(args.echo_latency_s, args.echo_latency_sigma)
    else:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        backend = ModelBackend(
            args.model_path,
            tokenizer_path=args.tokenizer,
            trust_remote_code=args.trust_remote_code,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.max_batch_size,
            gather_window_s=args.gather_window_s,
            max_model_len=args.max_model_len,
            default_max_tokens=args.default_max_tokens,
        )
    app = create_app(
        backend,
        model_name=model_name,
        dialect=args.dialect,
        faults=faults,
        token_ids=not args.no_token_ids,
    )
    log.info("serving %r, dialect %s, faults %s", model_name, args.dialect, dict(faults.rates))
    if isinstance(backend, ModelBackend):
        backend.start()
    try:
        asyncio.run(
            _serve(
                app,
                args.host,
                args.port,
                access_log=args.access_log,
                parent_pid=args.exit_with_parent,
            )
        )
    finally:
        if isinstance(backend, ModelBackend):
            backend.stop()
    return 0


async def _serve(
    app: web.Application, host: str, port: int, *, access_log: bool, parent_pid: int | None
) -> None:
    # A short shutdown timeout: handlers sleeping in an injected hang must not delay SIGTERM.
    runner = web.AppRunner(app, access_log=log if access_log else None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, shutdown_timeout=1.0)
    await site.start()
    bound_port = runner.addresses[0][1]
    url_host = f"[{host}]" if ":" in host else host
    print(f"{LISTENING_PREFIX}http://{url_host}:{bound_port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    watchdog = asyncio.create_task(_watch_parent(parent_pid, stop)) if parent_pid else None
    try:
        await stop.wait()
    finally:
        if watchdog is not None:
            watchdog.cancel()
        await runner.cleanup()
        log.info("stopped")


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    # An orphan is re-parented (to init or a subreaper), so its parent pid changes.
    while os.getppid() == parent_pid:
        await asyncio.sleep(1.0)
    log.warning("parent process %d is gone; stopping", parent_pid)
    stop.set()
