"""Rebuilding a sample's token ids when the server gave none: the prompt rendered by the chat
template with the request's kwargs, then `<think>` (unless the template opened the think block),
the reasoning, `</think>`, the content and the end of turn, think and end-of-turn tokens inserted
as ids. Each piece is tokenized on its own, which is what the model saw, since the tags around it
are added tokens that BPE never merges across; one batched tokenizer call per chunk.

With thinking switched off, the template pre-fills a closed, empty think block at the end of the
prompt (Qwen3 `<think>\n\n</think>\n\n`, Kimi-K2.5 `<think></think>`): the model writes the
content and the end of turn only, and so does the rebuild."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eaglenest.target_model.encoding import decode_batch, encode_batch
from eaglenest.target_model.tokenizer import TokenizeError

if TYPE_CHECKING:
    from eaglenest.target_model.special_tokens import TargetTokens


def template_kwargs(request_json: str, default: dict[str, Any], sample_id: str) -> dict[str, Any]:
    """The request's chat_template_kwargs (what the server rendered with), else the config's."""
    try:
        request = json.loads(request_json)
    except json.JSONDecodeError as err:
        raise TokenizeError(f"sample {sample_id}: its request is not JSON ({err})") from None
    kwargs = request.get("chat_template_kwargs") if isinstance(request, dict) else None
    return dict(kwargs) if isinstance(kwargs, dict) else dict(default)


def render_prompts(
    tokenizer: Any, messages: list[list[dict]], kwargs: list[dict], ids: list[str]
) -> list[str]:
    """Generation prompts as the server rendered them: one batched template call per distinct
    set of kwargs (usually one); a failure is rendered again alone to name its sample."""
    groups: dict[str, list[int]] = {}
    for k, chat_kwargs in enumerate(kwargs):
        groups.setdefault(json.dumps(chat_kwargs, sort_keys=True), []).append(k)
    rendered: list[str] = [""] * len(messages)
    for members in groups.values():
        chats = [messages[k] for k in members]
        try:
            texts = tokenizer.apply_chat_template(
                chats, add_generation_prompt=True, tokenize=False, **kwargs[members[0]]
            )
        except _template_errors():  # find the sample
            texts = [_render_one(tokenizer, messages[k], kwargs[k], ids[k]) for k in members]
        for k, text in zip(members, texts):
            rendered[k] = text
    return rendered


def _template_errors() -> tuple[type[Exception], ...]:
    import jinja2

    # As the server: template errors come from jinja and from the messages (roles, kwargs).
    return (jinja2.TemplateError, ValueError, TypeError, KeyError, AttributeError)


def _render_one(tokenizer: Any, chat: list[dict], chat_kwargs: dict, sample_id: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False, **chat_kwargs
        )
    except _template_errors() as err:
        raise TokenizeError(
            f"sample {sample_id}: the chat template failed ({type(err).__name__}: {err})"
        ) from err


def opens_think_block(prompt_ids: list[int], start_id: int, end_id: int) -> bool:
    """True when the prompt ends inside a think block the template opened (`<think>` or
    `<think>\\n` at the end of the generation prompt), so the model's output starts inside it."""
    last_start = _last_index(prompt_ids, start_id)
    return last_start >= 0 and last_start > _last_index(prompt_ids, end_id)


def closes_think_block(prompt: str, think_end: str) -> bool:
    """True when the rendered prompt ends with a think block the template closed (the thinking
    switch off: `</think>` and whitespace at its end), so the model's output is content only."""
    return prompt.rstrip().endswith(think_end)


def _last_index(ids: list[int], value: int) -> int:
    try:
        return len(ids) - 1 - ids[::-1].index(value)
    except ValueError:
        return -1


@dataclass
class Rebuild:
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    decodes_back: list[bool]  # reasoning and content ids decode to exactly the sample's text
    prompt_opens_think: list[bool]
    prompt_closes_think: list[bool]  # thinking off: the completion is content and end of turn


def rebuild_token_ids(
    tokenizer: Any,
    tokens: TargetTokens,
    messages: list[list[dict]],
    reasonings: list[str],
    contents: list[str],
    kwargs: list[dict],
    ids: list[str],
) -> Rebuild:
    """Rebuild prompt and completion ids of a chunk of samples with one batched tokenizer call."""
    prompts = render_prompts(tokenizer, messages, kwargs, ids)
    n = len(prompts)
    encoded = encode_batch(tokenizer, prompts + reasonings + contents)
    prompt_ids, reasoning_ids, content_ids = encoded[:n], encoded[n : 2 * n], encoded[2 * n :]
    decoded = decode_batch(tokenizer, reasoning_ids + content_ids)
    rebuild = Rebuild([], [], [], [], [])
    for k in range(n):
        opened = opens_think_block(prompt_ids[k], tokens.think_start_id, tokens.think_end_id)
        closed = not opened and closes_think_block(prompts[k], tokens.think_end)
        completion = [] if opened or closed else [tokens.think_start_id]
        if not closed:
            completion += reasoning_ids[k]
            completion.append(tokens.think_end_id)
        completion += content_ids[k]
        completion.append(tokens.end_of_turn_id)
        rebuild.prompt_ids.append(prompt_ids[k])
        rebuild.completion_ids.append(completion)
        # A closed block holds no reasoning: a sample with some does not decode back.
        reasoning_back = reasonings[k] == ("" if closed else decoded[k])
        rebuild.decodes_back.append(reasoning_back and decoded[n + k] == contents[k])
        rebuild.prompt_opens_think.append(opened)
        rebuild.prompt_closes_think.append(closed)
    return rebuild
