"""The target's tokens that tokenize inserts as ids (`<think>`, `</think>`, the end of turn) and
the facts of its vocabulary, resolved once per shard and checked against the target's tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglenest.common.reasoning import THINK_END, THINK_START
from eaglenest.settings.samples import TokenizeSettings
from eaglenest.target_model.tokenizer import (
    TokenizeError,
    end_of_turn,
    model_dir,
    special_token_ids,
    target_vocab_size,
)


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
