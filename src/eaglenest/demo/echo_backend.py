"""The echo backend of `eaglenest serve --echo`: canned answers with no model, no tokenizer."""

from __future__ import annotations

import asyncio
import math
import random
import re
from typing import Any

from eaglenest.common.reasoning import THINK_END, THINK_START
from eaglenest.demo.protocol import ChatRequest, Completion

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
