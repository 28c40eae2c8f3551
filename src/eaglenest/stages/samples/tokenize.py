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

The modules: rebuild.py (the rebuild), server_ids.py (the server's ids against it), rows.py (one
chunk's rows), frame.py (what the shard writes), report.py (its report and log lines); the
target's tokenizer, its batched encode and the inserted tokens are in eaglenest.target_model.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import polars as pl
from tqdm import tqdm

from eaglenest.common.io import atomic_path, read_json, write_json
from eaglenest.formats.samples import with_thinking
from eaglenest.formats.token_counts import TokenCounts, write_token_counts
from eaglenest.settings.samples import TokenizeSettings
from eaglenest.stages.samples.frame import (
    check_tokens,
    count_loss_tokens,
    loss_token_counts,
    tokens_frame,
)
from eaglenest.stages.samples.report import TokenizeReport
from eaglenest.stages.samples.rows import ShardTally, chunk_rows
from eaglenest.target_model.special_tokens import TargetTokens, resolve_target_tokens
from eaglenest.target_model.tokenizer import check_tokenizer_class, load_tokenizer, tokenizer_path

log = logging.getLogger(__name__)

CHUNK_SAMPLES = 512  # samples per batched tokenizer call: big enough to batch, small in memory


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


def tokenize_samples(
    samples: pl.DataFrame, settings: TokenizeSettings, think_ids: dict[str, Any], shard: str = ""
) -> tuple[pl.DataFrame, TokenCounts, dict[str, Any]]:
    """Tokenize a samples frame with the target's tokenizer and the think ids the probe resolved;
    raise TokenizeError when the rebuild agrees less often than tokenize.min_agreement, or when
    tokenize.max_length leaves the shard no sample."""
    started = time.perf_counter()
    tokenizer = load_tokenizer(settings.target)
    check_tokenizer_class(tokenizer, tokenizer_path(settings.target))
    tokens = resolve_target_tokens(tokenizer, think_ids, settings)
    log.info("shard %s: target tokens %s", shard, tokens.describe())
    default_kwargs = settings.target.chat_template_kwargs
    frame, counts, report = tokenize_frame(
        samples, tokenizer, tokens, settings, default_kwargs, shard
    )
    report.log(time.perf_counter() - started)
    report.check_kept()
    report.check_agreement(settings.min_agreement)
    return frame, counts, report.as_dict()


def tokenize_frame(
    samples: pl.DataFrame,
    tokenizer: Any,
    tokens: TargetTokens,
    settings: TokenizeSettings,
    default_kwargs: dict[str, Any],
    shard: str = "",
) -> tuple[pl.DataFrame, TokenCounts, TokenizeReport]:
    """Tokenize a samples frame with an open tokenizer: (tokens frame, loss-token counts, report)."""
    tally = ShardTally()
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=samples.height, desc=f"tokenize {shard}", unit="sample", mininterval=1.0)
    # A shard validated before the thinking mode was recorded gets it from its requests.
    for chunk in with_thinking(samples).iter_slices(CHUNK_SAMPLES):
        rows += chunk_rows(chunk, tokenizer, tokens, settings, default_kwargs, tally)
        bar.update(chunk.height)
    bar.close()
    frame, values, in_loss = tokens_frame(rows)
    loss_counts = count_loss_tokens(values, in_loss, tokens.vocab_size)
    check_tokens(frame, shard)
    report = TokenizeReport.of(shard, samples.height, frame, loss_counts, tally, tokens, settings)
    return frame, loss_token_counts(tokenizer, tokens, loss_counts), report
