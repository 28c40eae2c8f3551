"""The report of a tokenized shard (tokens/{shard}.report.json): what it wrote, how often the
rebuild agreed with the server's ids, what was dropped or changed and why; and its log lines,
read from the same fields."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eaglenest.common.thinking import mode_of_data, modes_of
from eaglenest.formats.tokens import TOKEN_SOURCES
from eaglenest.settings.samples import TokenizeSettings
from eaglenest.target_model.tokenizer import TokenizeError

if TYPE_CHECKING:
    import numpy as np
    import polars as pl

    from eaglenest.stages.samples.rows import ShardTally
    from eaglenest.target_model.special_tokens import TargetTokens

log = logging.getLogger(__name__)

# Counts of the tally that the report gives as they are.
_COUNTED = (
    "dropped_rebuild_decode_mismatch",
    "rebuild_decode_mismatch",
    "server_ids_text_mismatch",
    "parser_stripped_whitespace",
    "rebuilt_without_stripped_whitespace",
    "end_of_turn_appended",
    "prompt_opens_think_block",
    "prompt_closes_think_block",
)


@dataclass(frozen=True)
class Agreement:
    """How often the rebuild equals the server's ids, over the samples that have both; the
    whitespace the server's reasoning parser stripped from the text is put back first (it is in
    the ids, and the report says how often it was: TokenizeReport.parser_stripped_whitespace)."""

    compared: int
    exact: int
    share: float | None  # exact / compared; None when nothing was compared
    prompt_exact: int
    completion_exact: int
    # Mismatched samples whose ids decode to the rebuild's very text: another tokenization of
    # it, which the model wrote and no rebuild can know (the server's ids are used).
    retokenized: int
    first_mismatches: list[dict[str, Any]]  # up to tokenize.max_mismatches_logged


@dataclass(frozen=True)
class Overlength:
    """What tokenize.max_length did."""

    max_length: int | None
    policy: str
    dropped: int
    dropped_prompt_over_max_length: int
    truncated: int
    longest: int = 0  # the longest sample past max_length, in tokens (0: none)


@dataclass(frozen=True)
class TokenizeReport:
    shard: str
    samples: int
    written: int
    token_sources: dict[str, int]
    tokens: int
    loss_tokens: int
    agreement: Agreement
    overlength: Overlength
    dropped_rebuild_decode_mismatch: int
    rebuild_decode_mismatch: int
    server_ids_text_mismatch: int
    # Samples whose ids hold whitespace the reasoning parser stripped from the text (not
    # mismatches: the ids are what the model wrote), and which whitespace, by count.
    parser_stripped_whitespace: int
    stripped_whitespace: dict[str, int]
    # Rebuilt samples (no ids) when target.reasoning_parser strips: their whitespace is lost.
    rebuilt_without_stripped_whitespace: int
    reasoning_parser: str | None
    end_of_turn_appended: int
    prompt_opens_think_block: int
    # Rebuilt prompts ending in a closed think block (thinking off): completions are content only.
    prompt_closes_think_block: int
    target_tokens: dict[str, Any]
    settings: dict[str, Any]
    # The written samples' thinking mode (common/thinking.py): what a drafter trains in.
    thinking: dict[str, Any]

    @classmethod
    def of(
        cls,
        shard: str,
        n_samples: int,
        frame: pl.DataFrame,
        loss_counts: np.ndarray,
        tally: ShardTally,
        tokens: TargetTokens,
        settings: TokenizeSettings,
    ) -> TokenizeReport:
        counts = tally.counts
        compared = counts["compared"]
        agreement = Agreement(
            compared=compared,
            exact=counts["agreed"],
            share=counts["agreed"] / compared if compared else None,
            prompt_exact=counts["prompt_agreed"],
            completion_exact=counts["completion_agreed"],
            retokenized=counts["retokenized"],
            first_mismatches=tally.mismatches,
        )
        overlength = Overlength(
            max_length=settings.max_length,
            policy=settings.overlength,
            dropped=counts["dropped_overlength"],
            dropped_prompt_over_max_length=counts["dropped_prompt_over_max_length"],
            truncated=counts["truncated"],
            longest=counts["longest_overlength"],
        )
        return cls(
            shard=shard,
            samples=n_samples,
            written=frame.height,
            token_sources={source: counts[source] for source in TOKEN_SOURCES},
            tokens=int(frame["n_tokens"].sum()) if frame.height else 0,
            loss_tokens=int(loss_counts.sum()),
            agreement=agreement,
            overlength=overlength,
            **{name: counts[name] for name in _COUNTED},
            stripped_whitespace={repr(w): n for w, n in tally.stripped.most_common()},
            reasoning_parser=settings.target.reasoning_parser,
            target_tokens=tokens.describe(),
            settings=json.loads(settings.to_json()),  # the target: the fields tokenize reads
            thinking=_thinking(frame["thinking"].to_list()),
        )

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON writes it."""
        return dataclasses.asdict(self)

    def log(self, seconds: float) -> None:
        """The report's lines in the job's log; `seconds`: how long the shard took."""
        log.info(
            "shard %s: wrote %d of %d samples (%s), %d tokens (%d in the loss), %.2f s, "
            "%.0f tokens/s",
            self.shard,
            self.written,
            self.samples,
            self.token_sources,
            self.tokens,
            self.loss_tokens,
            seconds,
            self.tokens / seconds if seconds > 0 else 0.0,
        )
        log.info("shard %s: overlength %s", self.shard, dataclasses.asdict(self.overlength))
        agreement = self.agreement
        if agreement.compared:
            log.info(
                "shard %s: rebuild agrees with the server's ids for %d of %d samples (%.4f); "
                "prompts %d, completions %d; %d more hold the same text in other tokens",
                self.shard,
                agreement.exact,
                agreement.compared,
                agreement.share,
                agreement.prompt_exact,
                agreement.completion_exact,
                agreement.retokenized,
            )
        self._log_parser()
        for mismatch in agreement.first_mismatches:
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

    def _log_parser(self) -> None:
        """Once per shard: what the server's reasoning parser changed, and what a rebuild lost."""
        if self.parser_stripped_whitespace:
            log.info(
                "shard %s: the server's reasoning parser stripped trailing whitespace from the "
                "reasoning of %d samples (%s); their ids hold it and are used, and the rebuild "
                "is compared with it put back",
                self.shard,
                self.parser_stripped_whitespace,
                ", ".join(f"{w} x{n}" for w, n in self.stripped_whitespace.items()),
            )
        if self.rebuilt_without_stripped_whitespace:
            log.warning(
                "shard %s: %d samples rebuilt from text without the server's ids; its reasoning "
                "parser %s strips trailing whitespace from the reasoning, which a rebuild cannot "
                "recover: those sequences lack any whitespace the model wrote before %s",
                self.shard,
                self.rebuilt_without_stripped_whitespace,
                self.reasoning_parser,
                self.target_tokens["think_end"]["token"],
            )

    def check_kept(self) -> None:
        """Raise TokenizeError when the shard keeps no sample because each was too long: a
        max_length below the answers' lengths (a config merged over the demo's, say) would
        otherwise leave the later stages an empty shard to fail on, far from the cause."""
        over = self.overlength
        lost = over.dropped + over.dropped_prompt_over_max_length
        if self.samples and not self.written and lost:
            raise TokenizeError(
                f"shard {self.shard}: kept none of its {self.samples} samples: {lost} longer than "
                f"tokenize.max_length {over.max_length} (tokenize.overlength {over.policy}; the "
                f"longest {over.longest} tokens). Set tokenize.max_length to null (the default: no "
                "answer dropped for its length) or above the answers' lengths"
            )

    def check_agreement(self, min_agreement: float) -> None:
        """Raise TokenizeError when the rebuild agrees less often than tokenize.min_agreement."""
        agreement = self.agreement
        if agreement.share is not None and agreement.share < min_agreement:
            raise TokenizeError(
                f"shard {self.shard}: the rebuilt ids agree with the server's for "
                f"{agreement.exact} of {agreement.compared} samples ({agreement.share:.4f} < "
                f"tokenize.min_agreement {min_agreement}); first mismatches: "
                f"{agreement.first_mismatches}"
            )


def _thinking(modes: list[bool | None]) -> dict[str, Any]:
    counts = modes_of(modes)
    return {"mode": mode_of_data(counts), "samples": counts}
