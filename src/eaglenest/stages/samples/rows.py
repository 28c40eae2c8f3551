"""The token rows of one chunk of samples: the server's ids where it gave them (checked against
the sample's text, compared with the rebuild when `tokenize.verify_rebuild`), else the rebuild
where it decodes back to the sample's text; then `tokenize.max_length`. What happens to each
sample is counted in a ShardTally, which the report reads."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eaglenest.settings.samples import TokenizeSettings
from eaglenest.stages.samples.rebuild import rebuild_token_ids, template_kwargs
from eaglenest.stages.samples.server_ids import (
    STRIPPING_PARSERS,
    describe_mismatch,
    server_completion,
    server_text_check,
)
from eaglenest.target_model.encoding import decode_batch

if TYPE_CHECKING:
    import polars as pl

    from eaglenest.target_model.special_tokens import TargetTokens

log = logging.getLogger(__name__)


@dataclass
class ShardTally:
    """What the report counts, filled chunk by chunk."""

    counts: Counter = field(default_factory=Counter)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    stripped: Counter = field(default_factory=Counter)  # whitespace a parser stripped -> samples


def chunk_rows(
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
    thinking = chunk["thinking"].to_list()  # the sample's mode, carried to its tokens
    has_server = [
        p is not None and c is not None for p, c in zip(server_prompts, server_completions)
    ]
    with_ids = [k for k, s in enumerate(has_server) if s]
    decoded = decode_batch(tokenizer, [server_completions[k] for k in with_ids])
    counts = tally.counts
    # What the server's ids hold beyond the text: whitespace its reasoning parser stripped.
    stripped = {
        k: _check_server_text(ids[k], text, reasonings[k], contents[k], tokens, settings, tally)
        for k, text in zip(with_ids, decoded)
    }
    to_rebuild = [k for k, s in enumerate(has_server) if not s or settings.verify_rebuild]
    rebuild = rebuild_token_ids(
        tokenizer,
        tokens,
        [messages[k] for k in to_rebuild],
        # Compared with the server's ids as the model wrote it: the stripped whitespace put back.
        [reasonings[k] + (stripped.get(k) or "") for k in to_rebuild],
        [contents[k] for k in to_rebuild],
        [template_kwargs(requests[k], default_kwargs, ids[k]) for k in to_rebuild],
        [ids[k] for k in to_rebuild],
    )
    rebuilt_at = {k: j for j, k in enumerate(to_rebuild)}
    stop_ids = {*tokenizer.all_special_ids, tokens.end_of_turn_id}
    parser_strips = settings.target.reasoning_parser in STRIPPING_PARSERS
    rows = []
    for k, sample_id in enumerate(ids):
        j = rebuilt_at.get(k)
        rebuilt = None if j is None else (rebuild.prompt_ids[j], rebuild.completion_ids[j])
        if j is not None:
            counts["prompt_opens_think_block"] += rebuild.prompt_opens_think[j]
            counts["prompt_closes_think_block"] += rebuild.prompt_closes_think[j]
            counts["rebuild_decode_mismatch"] += not rebuild.decodes_back[j]
        agrees = None
        if has_server[k]:
            completion, appended = server_completion(
                server_completions[k], finish[k], tokens, stop_ids
            )
            counts["end_of_turn_appended"] += appended
            prompt, source = list(server_prompts[k]), "server"
            if rebuilt is not None:
                agrees = _compare_with_rebuild(
                    tokenizer, sample_id, (prompt, completion), rebuilt, settings, tally
                )
        elif rebuild.decodes_back[j]:
            (prompt, completion), source = rebuilt, "rebuilt"
            # The whitespace the parser stripped is gone from the text, so from the rebuild.
            counts["rebuilt_without_stripped_whitespace"] += parser_strips
        else:
            counts["dropped_rebuild_decode_mismatch"] += 1
            if counts["dropped_rebuild_decode_mismatch"] <= settings.max_mismatches_logged:
                log.warning("sample %s: rebuilt ids do not decode to its text; dropped", sample_id)
            continue
        row = _token_row(sample_id, prompt, completion, source, agrees, settings, counts)
        if row is not None:
            rows.append({**row, "thinking": thinking[k]})
    return rows


def _apply_max_length(
    input_ids: list[int], prompt_len: int, settings: TokenizeSettings, counts: Counter
) -> tuple[list[int] | None, bool]:
    """The sequence to write (None: dropped) and whether it was cut."""
    if settings.max_length is None or len(input_ids) <= settings.max_length:
        return input_ids, False
    counts["longest_overlength"] = max(counts["longest_overlength"], len(input_ids))
    if settings.overlength == "drop":
        counts["dropped_overlength"] += 1
        return None, False
    if prompt_len >= settings.max_length:
        counts["dropped_prompt_over_max_length"] += 1
        return None, False
    counts["truncated"] += 1
    return input_ids[: settings.max_length], True


def _check_server_text(
    sample_id: str,
    decoded: str,
    reasoning: str,
    content: str,
    tokens: TargetTokens,
    settings: TokenizeSettings,
    tally: ShardTally,
) -> str | None:
    """The server's ids must decode to text holding its reasoning, `</think>` and content, or the
    reasoning plus whitespace its parser stripped (counted, said once per shard by the report),
    or (no reasoning: thinking off) the content alone;
    returns that whitespace ("" when none, None when the ids do not hold the text)."""
    counts = tally.counts
    whitespace = server_text_check(decoded, reasoning, tokens.think_end, content)
    if whitespace:
        counts["parser_stripped_whitespace"] += 1
        tally.stripped[whitespace] += 1
    if whitespace is not None:
        return whitespace
    counts["server_ids_text_mismatch"] += 1
    if counts["server_ids_text_mismatch"] <= settings.max_mismatches_logged:
        log.warning(
            "sample %s: the server's completion ids decode to %r, which does not hold its "
            "reasoning, end-of-think tag and content (or, without reasoning, its content)",
            sample_id,
            decoded[:300],
        )
    return None


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
    if agrees:
        return True
    # A model sampling token by token may write a tokenization of its text that the tokenizer
    # would not choose (e.g. two digits where one token holds both): no rebuild from text can
    # know it, and the text itself is intact. Counted apart from a text that differs.
    server_text, rebuilt_text = decode_batch(tokenizer, [server_ids, rebuilt_ids])
    same_text = server_text == rebuilt_text
    tally.counts["retokenized"] += same_text
    if len(tally.mismatches) < settings.max_mismatches_logged:
        tally.mismatches.append(
            describe_mismatch(
                tokenizer, sample_id, server_ids, rebuilt_ids, len(server[0]), same_text
            )
        )
    return False


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
