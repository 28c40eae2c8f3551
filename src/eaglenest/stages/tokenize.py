"""Tokenize: the exact token sequence of every sample, think tokens included, and its loss mask.

Exact tokens first. When the server returned ids, the sequence is `prompt_token_ids +
completion_token_ids`: what the model read and wrote. Otherwise it is rebuilt with the target's
tokenizer: the prompt rendered by the chat template with the request's `chat_template_kwargs`,
then `<think>` (unless the template already opened the think block in the prompt, as Kimi-K2.5,
Qwen3-Thinking and DeepSeek-R1 templates do), the reasoning, `</think>`, the content and the
end-of-turn token. Think and end-of-turn tokens go in as ids, never as text to re-tokenize, and
no text is stripped or re-joined: rendering a whole conversation would let templates drop the
reasoning of assistant turns. Each piece is tokenized on its own, which is what the model saw,
since the tags around it are added tokens that BPE never merges across.

Every rebuild is checked by decoding its pieces back to the sample's text; when the server gave
ids, the rebuild is compared with them too, and the report gives the share of exact agreements
with the first mismatches. The loss covers the completion: reasoning, `</think>`, content and
end of turn; `prompt_len` marks where it starts (the mask is 0 before it, 1 from it on).

Pieces are tokenized in batches (one tokenizer call per chunk of samples) because per-piece calls
would make the stage many times slower than the tokenizer itself.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import weakref
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandera.errors
import polars as pl
import pyarrow as pa
from tqdm import tqdm

from eaglenest.client.reasoning import THINK_END, THINK_START
from eaglenest.common.io import atomic_path, read_json, write_json
from eaglenest.formats.token_counts import TokenCounts, write_token_counts
from eaglenest.formats.tokens import TOKEN_SOURCES, TokensSchema, empty_tokens_frame
from eaglenest.settings.samples import TokenizeSettings
from eaglenest.target.tokenizer import (
    TokenizeError,
    check_tokenizer_class,
    end_of_turn,
    load_tokenizer,
    model_dir,
    special_token_ids,
    target_vocab_size,
    tokenizer_path,
)

log = logging.getLogger(__name__)

CHUNK_SAMPLES = 512  # samples per batched tokenizer call: big enough to batch, small in memory
MISMATCH_WINDOW = 6  # ids shown on each side of a mismatch


@dataclass(frozen=True)
class TargetTokens:
    """The ids the stage inserts, and facts of the target vocabulary."""

    think_start_id: int
    think_end_id: int
    end_of_turn_id: int
    think_start: str = THINK_START
    think_end: str = THINK_END
    end_of_turn: str = ""
    end_of_turn_source: str = ""
    think_source: str = ""
    vocab_size: int = 0  # rows of the target's embedding: counts and t2d are this long
    special_ids: tuple[int, ...] = ()  # added and special tokens (kept in the draft vocab if used)

    def describe(self) -> dict[str, Any]:
        return {
            "think_start": {"token": self.think_start, "id": self.think_start_id},
            "think_end": {"token": self.think_end, "id": self.think_end_id},
            "think_source": self.think_source,
            "end_of_turn": {
                "token": self.end_of_turn,
                "id": self.end_of_turn_id,
                "source": self.end_of_turn_source,
            },
            "target_vocab_size": self.vocab_size,
        }


# --- the target's tokenizer -------------------------------------------------------------------


def check_think_ids(tokenizer: Any, ids: dict[str, Any]) -> None:
    """The tokenizer's own ids of the think tokens must be those of probe.json (the config's, or
    the probe's tokenizer's): a tokenizer that is not the target's (e.g. transformers' fallback
    when remote code is off) would mask and rebuild around the wrong tokens."""
    for name in ("start", "end"):
        token, expected = ids[name], int(ids[f"{name}_id"])
        found = tokenizer.convert_tokens_to_ids(token)
        if found == expected and tokenizer.decode([expected], skip_special_tokens=False) == token:
            continue
        is_single = found is not None and tokenizer.convert_ids_to_tokens(found) == token
        has = f"has {token!r} as id {found}" if is_single else f"has no single token {token!r}"
        decoded = tokenizer.decode([expected], skip_special_tokens=False)
        raise TokenizeError(
            f"think {name} token: probe.json says {token!r} is id {expected} (source: "
            f"{ids.get('source')}), but the tokenizer ({type(tokenizer).__name__}, "
            f"{getattr(tokenizer, 'name_or_path', '')}) {has}, and id {expected} decodes to "
            f"{decoded!r}. The tokenizer is not the target's, or target.think_tokens is wrong: "
            "set target.tokenizer (and target.trust_remote_code if it is remote code), or "
            f"target.think_tokens.{name} and {name}_id to the model's, and rerun the probe"
        )


def resolve_target_tokens(
    tokenizer: Any, think_ids: dict[str, Any], settings: TokenizeSettings
) -> TargetTokens:
    """The think ids the probe resolved (probe.json `think_token_ids`: the config's override,
    else the tokenizer's), the end of turn and the vocabulary size."""
    ids = think_ids
    if ids.get("start_id") is None or ids.get("end_id") is None:
        raise TokenizeError(
            f"no think token ids in probe.json (source: {ids.get('source')}): set target.tokenizer "
            "or target.path, or target.think_tokens.start_id and end_id, and rerun the probe"
        )
    check_think_ids(tokenizer, ids)
    model_path = model_dir(settings.target)
    eot, eot_id, eot_source = end_of_turn(tokenizer, settings.end_of_turn_token, model_path)
    return TargetTokens(
        think_start_id=int(ids["start_id"]),
        think_end_id=int(ids["end_id"]),
        end_of_turn_id=eot_id,
        think_start=ids["start"],
        think_end=ids["end"],
        end_of_turn=eot,
        end_of_turn_source=eot_source,
        think_source=ids["source"],
        vocab_size=target_vocab_size(tokenizer, model_path),
        special_ids=special_token_ids(tokenizer, ids["start_id"], ids["end_id"], eot_id),
    )


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts, add_special_tokens=False)` ids; through the Rust tokenizer's
    `encode_batch_fast` (no offsets, a third faster) when that gives the very same ids."""
    if not texts:
        return []
    if _fast_encoder_ok(tokenizer):
        encodings = tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [encoding.ids for encoding in encodings]
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]


_FAST_ENCODER_PROBE = [
    "Hi <think>\n 2 + 2 = **4**\n\n</think>\n\n x<|im_end|>",
    " \t\u00e9\u4e2d 12 \n",
]


_FAST_ENCODER_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per tokenizer object


def _fast_encoder_ok(tokenizer: Any) -> bool:
    """True when the Rust batch encode is what `tokenizer(...)` runs: a fast tokenizer whose class
    changes nothing on the way, same special-token handling, and same ids on a probe text."""
    if tokenizer in _FAST_ENCODER_OK:
        return _FAST_ENCODER_OK[tokenizer]
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "backend_tokenizer", None)
    ok = (
        isinstance(tokenizer, TokenizersBackend)
        and hasattr(backend, "encode_batch_fast")
        and type(tokenizer)._encode_plus is TokenizersBackend._encode_plus
        and type(tokenizer).__call__ is TokenizersBackend.__call__
        and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))
    )
    if ok:
        expected = tokenizer(_FAST_ENCODER_PROBE, add_special_tokens=False)["input_ids"]
        fast = backend.encode_batch_fast(_FAST_ENCODER_PROBE, add_special_tokens=False)
        ok = [e.ids for e in fast] == expected
    _FAST_ENCODER_OK[tokenizer] = ok
    return ok


def _decode(tokenizer: Any, ids: list[list[int]]) -> list[str]:
    if not ids:
        return []
    if getattr(tokenizer, "is_fast", False):
        # The Rust decoder directly: the same text as tokenizer.decode without cleanup, 3x faster.
        return tokenizer.backend_tokenizer.decode_batch(ids, skip_special_tokens=False)
    return tokenizer.batch_decode(
        ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


# --- one chunk of samples ---------------------------------------------------------------------


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
    encoded = _encode(tokenizer, prompts + reasonings + contents)
    prompt_ids, reasoning_ids, content_ids = encoded[:n], encoded[n : 2 * n], encoded[2 * n :]
    decoded = _decode(tokenizer, reasoning_ids + content_ids)
    rebuild = Rebuild([], [], [], [])
    for k in range(n):
        opened = opens_think_block(prompt_ids[k], tokens.think_start_id, tokens.think_end_id)
        completion = [] if opened else [tokens.think_start_id]
        completion += reasoning_ids[k]
        completion.append(tokens.think_end_id)
        completion += content_ids[k]
        completion.append(tokens.end_of_turn_id)
        rebuild.prompt_ids.append(prompt_ids[k])
        rebuild.completion_ids.append(completion)
        rebuild.decodes_back.append(decoded[k] == reasonings[k] and decoded[n + k] == contents[k])
        rebuild.prompt_opens_think.append(opened)
    return rebuild


def server_completion(
    completion_ids: list[int], finish_reason: str | None, tokens: TargetTokens, stop_ids: set[int]
) -> tuple[list[int], bool]:
    """The server's completion ids, with the end-of-turn id appended when the model stopped on it
    but the server left it out (it is a generated token the drafter must learn)."""
    if finish_reason == "stop" and (not completion_ids or completion_ids[-1] not in stop_ids):
        return [*completion_ids, tokens.end_of_turn_id], True
    return list(completion_ids), False


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (length counts), None if equal."""
    if a == b:
        return None
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return min(len(a), len(b))


def describe_mismatch(
    tokenizer: Any, sample_id: str, server: list[int], rebuilt: list[int], prompt_len: int
) -> dict[str, Any]:
    position = first_difference(server, rebuilt)
    window = slice(max(0, position - MISMATCH_WINDOW), position + MISMATCH_WINDOW)
    server_ids, rebuilt_ids = server[window], rebuilt[window]
    server_text, rebuilt_text = _decode(tokenizer, [server_ids, rebuilt_ids])
    return {
        "id": sample_id,
        "part": "prompt" if position < prompt_len else "completion",
        "position": position,
        "window_start": window.start,
        "server_ids": server_ids,
        "rebuilt_ids": rebuilt_ids,
        "server_text": server_text,
        "rebuilt_text": rebuilt_text,
        "server_len": len(server),
        "rebuilt_len": len(rebuilt),
    }


# --- the shard --------------------------------------------------------------------------------


@dataclass
class ShardTally:
    """What the report counts, filled chunk by chunk."""

    counts: Counter
    mismatches: list[dict[str, Any]]


def _apply_max_length(
    input_ids: list[int], prompt_len: int, settings: TokenizeSettings, counts: Counter
) -> tuple[list[int] | None, bool]:
    """The sequence to write (None: dropped) and whether it was cut."""
    if settings.max_length is None or len(input_ids) <= settings.max_length:
        return input_ids, False
    if settings.overlength == "drop":
        counts["dropped_overlength"] += 1
        return None, False
    if prompt_len >= settings.max_length:
        counts["dropped_prompt_over_max_length"] += 1
        return None, False
    counts["truncated"] += 1
    return input_ids[: settings.max_length], True


def _check_server_text(
    sample_id: str, decoded: str, expected: str, settings: TokenizeSettings, counts: Counter
) -> None:
    """The server's ids must decode to text holding its reasoning, `</think>` and content."""
    if expected in decoded:
        return
    counts["server_ids_text_mismatch"] += 1
    if counts["server_ids_text_mismatch"] <= settings.max_mismatches_logged:
        log.warning(
            "sample %s: the server's completion ids decode to %r, which does not hold its "
            "reasoning, end-of-think tag and content",
            sample_id,
            decoded[:300],
        )


def _compare_with_rebuild(
    tokenizer: Any,
    sample_id: str,
    server: tuple[list[int], list[int]],
    rebuilt: tuple[list[int], list[int]],
    settings: TokenizeSettings,
    tally: ShardTally,
) -> bool:
    """Whether the rebuild equals the server's (prompt, completion); counted in `tally`."""
    server_ids, rebuilt_ids = server[0] + server[1], rebuilt[0] + rebuilt[1]
    agrees = server_ids == rebuilt_ids
    tally.counts["compared"] += 1
    tally.counts["agreed"] += agrees
    tally.counts["prompt_agreed"] += server[0] == rebuilt[0]
    tally.counts["completion_agreed"] += server[1] == rebuilt[1]
    if not agrees and len(tally.mismatches) < settings.max_mismatches_logged:
        tally.mismatches.append(
            describe_mismatch(tokenizer, sample_id, server_ids, rebuilt_ids, len(server[0]))
        )
    return agrees


def _token_row(
    sample_id: str,
    prompt: list[int],
    completion: list[int],
    source: str,
    agrees: bool | None,
    settings: TokenizeSettings,
    counts: Counter,
) -> dict[str, Any] | None:
    """The sample's row of the tokens frame; None when tokenize.max_length drops it."""
    input_ids, truncated = _apply_max_length(prompt + completion, len(prompt), settings, counts)
    if input_ids is None:
        return None
    counts[source] += 1
    return {
        "id": sample_id,
        "input_ids": input_ids,
        "prompt_len": len(prompt),
        "n_tokens": len(input_ids),
        "token_source": source,
        "truncated": truncated,
        "rebuild_agrees": agrees,
    }


def tokenize_chunk(
    chunk: pl.DataFrame,
    tokenizer: Any,
    tokens: TargetTokens,
    settings: TokenizeSettings,
    default_kwargs: dict[str, Any],
    tally: ShardTally,
) -> list[dict[str, Any]]:
    """Token rows of one chunk of samples; counts and mismatches go to `tally`."""
    ids, finish, reasonings, contents, requests, messages, server_prompts, server_completions = (
        chunk[column].to_list()
        for column in (
            "id",
            "finish_reason",
            "reasoning",
            "content",
            "request",
            "messages",
            "prompt_token_ids",
            "completion_token_ids",
        )
    )
    has_server = [
        p is not None and c is not None for p, c in zip(server_prompts, server_completions)
    ]
    to_rebuild = [k for k, s in enumerate(has_server) if not s or settings.verify_rebuild]
    rebuild = rebuild_token_ids(
        tokenizer,
        tokens,
        [messages[k] for k in to_rebuild],
        [reasonings[k] for k in to_rebuild],
        [contents[k] for k in to_rebuild],
        [template_kwargs(requests[k], default_kwargs, ids[k]) for k in to_rebuild],
        [ids[k] for k in to_rebuild],
    )
    rebuilt_at = {k: j for j, k in enumerate(to_rebuild)}
    with_ids = [k for k, s in enumerate(has_server) if s]
    decoded = dict(zip(with_ids, _decode(tokenizer, [server_completions[k] for k in with_ids])))
    stop_ids = {*tokenizer.all_special_ids, tokens.end_of_turn_id}
    counts = tally.counts
    rows = []
    for k, sample_id in enumerate(ids):
        j = rebuilt_at.get(k)
        rebuilt = None if j is None else (rebuild.prompt_ids[j], rebuild.completion_ids[j])
        if j is not None:
            counts["prompt_opens_think_block"] += rebuild.prompt_opens_think[j]
            counts["rebuild_decode_mismatch"] += not rebuild.decodes_back[j]
        agrees = None
        if has_server[k]:
            completion, appended = server_completion(
                server_completions[k], finish[k], tokens, stop_ids
            )
            counts["end_of_turn_appended"] += appended
            prompt, source = list(server_prompts[k]), "server"
            expected = reasonings[k] + tokens.think_end + contents[k]
            _check_server_text(sample_id, decoded[k], expected, settings, counts)
            if rebuilt is not None:
                agrees = _compare_with_rebuild(
                    tokenizer, sample_id, (prompt, completion), rebuilt, settings, tally
                )
        elif rebuild.decodes_back[j]:
            (prompt, completion), source = rebuilt, "rebuilt"
        else:
            counts["dropped_rebuild_decode_mismatch"] += 1
            if counts["dropped_rebuild_decode_mismatch"] <= settings.max_mismatches_logged:
                log.warning("sample %s: rebuilt ids do not decode to its text; dropped", sample_id)
            continue
        row = _token_row(sample_id, prompt, completion, source, agrees, settings, counts)
        if row is not None:
            rows.append(row)
    return rows


def tokens_frame(rows: list[dict[str, Any]]) -> tuple[pl.DataFrame, np.ndarray, np.ndarray]:
    """The rows as a frame of `TokensSchema`, with all ids flat and the mask of loss positions
    (ids go to arrow as one array: no per-id Python objects)."""
    if not rows:
        return empty_tokens_frame(), np.zeros(0, np.int64), np.zeros(0, bool)
    lengths = np.fromiter((len(r["input_ids"]) for r in rows), dtype=np.int64, count=len(rows))
    prompt_lens = np.fromiter((r["prompt_len"] for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = np.fromiter(
        itertools.chain.from_iterable(r["input_ids"] for r in rows),
        dtype=np.int64,
        count=int(offsets[-1]),
    )
    position = np.arange(len(values)) - np.repeat(offsets[:-1], lengths)
    in_loss = position >= np.repeat(prompt_lens, lengths)
    frame = pl.DataFrame(
        {
            "id": [r["id"] for r in rows],
            "input_ids": pl.from_arrow(pa.LargeListArray.from_arrays(offsets, values)),
            "prompt_len": prompt_lens,
            "n_tokens": lengths,
            "token_source": [r["token_source"] for r in rows],
            "truncated": [r["truncated"] for r in rows],
            "rebuild_agrees": pl.Series([r["rebuild_agrees"] for r in rows], dtype=pl.Boolean),
        },
        schema=empty_tokens_frame().schema,
    )
    return frame, values, in_loss


def count_loss_tokens(values: np.ndarray, in_loss: np.ndarray, vocab_size: int) -> np.ndarray:
    """How often each target id is a loss token (int64 [vocab_size])."""
    loss_ids = values[in_loss]
    if loss_ids.size and (loss_ids.min() < 0 or loss_ids.max() >= vocab_size):
        raise TokenizeError(
            f"token id {int(loss_ids.max())} is outside the target vocabulary of {vocab_size} ids "
            "(tokenizer and model disagree, or the server ids come from another model)"
        )
    return np.bincount(loss_ids, minlength=vocab_size).astype(np.int64)


def tokenize_frame(
    samples: pl.DataFrame,
    tokenizer: Any,
    tokens: TargetTokens,
    settings: TokenizeSettings,
    default_kwargs: dict[str, Any],
    shard: str = "",
) -> tuple[pl.DataFrame, TokenCounts, dict[str, Any]]:
    """Tokenize a samples frame: (tokens frame, loss-token counts, report)."""
    tally = ShardTally(Counter(), [])
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=samples.height, desc=f"tokenize {shard}", unit="sample", mininterval=1.0)
    for chunk in samples.iter_slices(CHUNK_SAMPLES):
        rows += tokenize_chunk(chunk, tokenizer, tokens, settings, default_kwargs, tally)
        bar.update(chunk.height)
    bar.close()
    frame, values, in_loss = tokens_frame(rows)
    loss_counts = count_loss_tokens(values, in_loss, tokens.vocab_size)
    try:
        TokensSchema.validate(frame, lazy=True)
    except pandera.errors.SchemaErrors as err:
        log.error("tokens of shard %s failed their schema:\n%s", shard, err.failure_cases)
        raise TokenizeError(f"shard {shard}: tokens do not match their schema: {err}") from err
    counts = tally.counts
    compared = counts["compared"]
    report = {
        "shard": shard,
        "samples": samples.height,
        "written": frame.height,
        "token_sources": {source: counts[source] for source in TOKEN_SOURCES},
        "tokens": int(frame["n_tokens"].sum()) if frame.height else 0,
        "loss_tokens": int(loss_counts.sum()),
        "agreement": {
            "compared": compared,
            "exact": counts["agreed"],
            "share": counts["agreed"] / compared if compared else None,
            "prompt_exact": counts["prompt_agreed"],
            "completion_exact": counts["completion_agreed"],
            "first_mismatches": tally.mismatches,
        },
        "overlength": {
            "max_length": settings.max_length,
            "policy": settings.overlength,
            "dropped": counts["dropped_overlength"],
            "dropped_prompt_over_max_length": counts["dropped_prompt_over_max_length"],
            "truncated": counts["truncated"],
        },
        "dropped_rebuild_decode_mismatch": counts["dropped_rebuild_decode_mismatch"],
        "rebuild_decode_mismatch": counts["rebuild_decode_mismatch"],
        "server_ids_text_mismatch": counts["server_ids_text_mismatch"],
        "end_of_turn_appended": counts["end_of_turn_appended"],
        "prompt_opens_think_block": counts["prompt_opens_think_block"],
        "target_tokens": tokens.describe(),
        "settings": {f.name: getattr(settings, f.name) for f in fields(settings)},
    }
    token_counts = TokenCounts(
        loss_counts,
        np.asarray(tokens.special_ids, dtype=np.int64),
        _special_token_texts(tokenizer, tokens.special_ids, loss_counts),
    )
    return frame, token_counts, report


def _special_token_texts(tokenizer: Any, special_ids: tuple[int, ...], counts: np.ndarray) -> dict:
    used = [i for i in special_ids if counts[i] > 0]
    return dict(zip(used, tokenizer.convert_ids_to_tokens(used))) if used else {}


def _log_report(report: dict[str, Any], seconds: float) -> None:
    agreement = report["agreement"]
    log.info(
        "shard %s: wrote %d of %d samples (%s), %d tokens (%d in the loss), %.2f s, %.0f tokens/s",
        report["shard"],
        report["written"],
        report["samples"],
        report["token_sources"],
        report["tokens"],
        report["loss_tokens"],
        seconds,
        report["tokens"] / seconds if seconds > 0 else 0.0,
    )
    log.info("shard %s: overlength %s", report["shard"], report["overlength"])
    if agreement["compared"]:
        log.info(
            "shard %s: rebuild agrees with the server's ids for %d of %d samples (%.4f); prompts "
            "%d, completions %d",
            report["shard"],
            agreement["exact"],
            agreement["compared"],
            agreement["share"],
            agreement["prompt_exact"],
            agreement["completion_exact"],
        )
    for mismatch in agreement["first_mismatches"]:
        log.warning(
            "mismatch in sample %s at %s position %d: server %s %r, rebuilt %s %r",
            mismatch["id"],
            mismatch["part"],
            mismatch["position"],
            mismatch["server_ids"],
            mismatch["server_text"],
            mismatch["rebuilt_ids"],
            mismatch["rebuilt_text"],
        )


def tokenize_samples(
    samples: pl.DataFrame, settings: TokenizeSettings, think_ids: dict[str, Any], shard: str = ""
) -> tuple[pl.DataFrame, TokenCounts, dict[str, Any]]:
    """Tokenize a samples frame with the target's tokenizer and the think ids the probe resolved;
    raise TokenizeError when the rebuild agrees less often than tokenize.min_agreement."""
    started = time.perf_counter()
    tokenizer = load_tokenizer(settings.target)
    check_tokenizer_class(tokenizer, tokenizer_path(settings.target))
    tokens = resolve_target_tokens(tokenizer, think_ids, settings)
    log.info("shard %s: target tokens %s", shard, tokens.describe())
    default_kwargs = settings.target["chat_template_kwargs"]
    frame, counts, report = tokenize_frame(
        samples, tokenizer, tokens, settings, default_kwargs, shard
    )
    _log_report(report, time.perf_counter() - started)
    agreement = report["agreement"]
    if agreement["share"] is not None and agreement["share"] < settings.min_agreement:
        raise TokenizeError(
            f"shard {shard}: the rebuilt ids agree with the server's for {agreement['exact']} of "
            f"{agreement['compared']} samples ({agreement['share']:.4f} < tokenize.min_agreement "
            f"{settings.min_agreement}); first mismatches: {agreement['first_mismatches']}"
        )
    return frame, counts, report


def tokenize_shard(
    samples: str | Path,
    probe: str | Path,
    tokens_out: str | Path,
    counts_out: str | Path,
    report_out: str | Path,
    settings: TokenizeSettings,
    shard: str = "",
) -> dict[str, Any]:
    """The tokenize stage for one shard: tokens/{shard}.parquet, its counts and its report."""
    think_ids = read_json(probe)["think_token_ids"]
    frame, counts, report = tokenize_samples(pl.read_parquet(samples), settings, think_ids, shard)
    with atomic_path(tokens_out) as tmp:
        frame.write_parquet(tmp)
    write_token_counts(counts_out, counts, shard)
    write_json(report_out, report)
    return report
