"""A set's turns against the target's context, checked when the set is prepared: a prompt longer
than the target's positions was found only at evaluation, after training, in vLLM's words (a 20 MB
row asked vLLM for max_model_len 16,000,077 on a 1,024-position target). Each row's longest turn,
as the evaluation renders it (target_model/set_turns.py), plus the tokens generated after it must
fit the target's positions, or vllm.max_model_len where the user fixed it."""

from __future__ import annotations

import logging
from typing import Any

from eaglenest.settings.eval_sets import EvalSetLimits, EvalSetSettings
from eaglenest.stages.eval_sets.files import EvalSetError
from eaglenest.target_model.set_turns import rendered_turns, target_positions
from eaglenest.target_model.tokenizer import load_tokenizer, model_dir

log = logging.getLogger(__name__)
LISTED_ROWS = 10  # rows one error lists (the count says how many more)


def context_limit(limits: EvalSetLimits) -> tuple[int, str] | None:
    """The positions a turn and its answer must fit, and what set them; None when neither the
    config nor the target's files say."""
    if limits.max_model_len is not None:
        return limits.max_model_len, "vllm.max_model_len"
    target_dir = model_dir(limits.target)
    positions = target_positions(target_dir) if target_dir is not None else None
    if positions is None:
        return None
    return positions, f"the target's max_position_embeddings ({target_dir}/config.json)"


def check_lengths(settings: EvalSetSettings, rows: list[dict[str, Any]], limits: EvalSetLimits):
    """Raise EvalSetError naming set, rows, lengths and the limit for every row whose longest
    turn and its answer do not fit."""
    limit = context_limit(limits)
    if limit is None:
        log.warning("%s: the target's positions are unknown: turns not checked", settings.name)
        return
    positions, source = limit
    tokenizer = load_tokenizer(limits.target)
    kwargs = dict(limits.target.chat_template_kwargs)
    sized = rendered_turns(tokenizer, rows, kwargs, limits.max_new_tokens)
    too_long = [
        f"{row['where']}: its longest turn's prompt is {longest:,} tokens, with "
        f"{limits.max_new_tokens:,} to generate {longest + limits.max_new_tokens:,}"
        for row, (_, longest) in zip(rows, sized, strict=True)
        if longest + limits.max_new_tokens > positions
    ]
    if too_long:
        more = len(too_long) - LISTED_ROWS
        listed = "\n  ".join(too_long[:LISTED_ROWS]) + (
            f"\n  ... and {more} more" if more > 0 else ""
        )
        raise EvalSetError(
            f"evaluate.sets {settings.name!r}: {settings.path}: {len(too_long)} of {len(rows)} "
            f"rows do not fit the {positions:,} positions of {source}:\n  {listed}\n"
            "shorten or remove those rows, or lower evaluate.live_max_new_tokens"
        )
    log.info("%s: every turn fits %d positions (%s)", settings.name, positions, source)
