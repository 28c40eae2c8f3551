"""How a row of an evaluation set becomes the target's prompts: its turns as chats, rendered by
the target's chat template, and the longest prompt its turns can reach once the target has
answered the earlier ones. The set stage checks that length against the target's positions before
any training; the evaluate stage sizes vLLM's max_model_len with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eaglenest.target_model.encoding import encode_batch

# Room for one earlier answer rendered back into a later turn's prompt, beyond its tokens: the
# template's wrapping and a re-tokenized text that may take a few ids more than were generated.
ANSWER_SLACK = 32


def row_chat(row: dict[str, Any], turns: int) -> list[dict[str, str]]:
    """The first `turns` user turns of a row, with empty answers between them (for the size)."""
    messages = [{"role": "system", "content": row["system"]}] if row["system"] else []
    for index, turn in enumerate(row["turns"][:turns]):
        if index:
            messages.append({"role": "assistant", "content": ""})
        messages.append({"role": "user", "content": turn})
    return messages


def render_chats(
    tokenizer: Any, chats: list[list[dict]], kwargs: dict[str, Any]
) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **kwargs)
        for chat in chats
    ]
    return encode_batch(tokenizer, texts)


def rendered_turns(
    tokenizer: Any, rows: list[dict[str, Any]], kwargs: dict[str, Any], max_new_tokens: int
) -> list[tuple[list[int], int]]:
    """Per row: its first turn's prompt ids, and the longest prompt any of its turns reaches with
    every earlier turn answered in up to `max_new_tokens` tokens."""
    firsts = render_chats(tokenizer, [row_chat(row, 1) for row in rows], kwargs)
    wholes = render_chats(tokenizer, [row_chat(row, len(row["turns"])) for row in rows], kwargs)
    sized = []
    for row, first, whole in zip(rows, firsts, wholes, strict=True):
        earlier = len(row["turns"]) - 1
        sized.append(
            (first, max(len(first), len(whole) + earlier * (max_new_tokens + ANSWER_SLACK)))
        )
    return sized


def target_positions(target_dir: str | Path) -> int | None:
    """The positions the target was built for (its text config's max_position_embeddings: a
    multimodal wrapper's text_config, Kimi-K2.5's); None when its config.json does not say."""
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    positions = (config.get("text_config") or config).get("max_position_embeddings")
    return positions if isinstance(positions, int) else None
