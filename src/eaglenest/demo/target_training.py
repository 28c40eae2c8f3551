"""Training of the demo target: chats rendered by its template, packed into rows, and a fixed
number of AdamW steps (warmup + cosine), deterministic for a seed."""

from __future__ import annotations

import math
import random
import sys
from typing import Any

from eaglenest.demo.example import DemoExample
from eaglenest.demo.tasks import END_OF_TURN, PAD_TOKEN

ROW_TOKENS = 256  # packed training row length; short rows keep attention cost small


def chat_messages(example: DemoExample, with_answer: bool) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": example.prompt}]
    if with_answer:
        messages.append(
            {"role": "assistant", "content": example.answer, "reasoning_content": example.reasoning}
        )
    return messages


def encode_training_batch(
    tokenizer: Any, examples: list[DemoExample]
) -> list[tuple[list[int], int]]:
    """Token ids of each full chat, ending at `<|im_end|>`, and its prompt length in tokens.

    Texts are rendered by the chat template and tokenized in one batch (fast); the prompt must be
    a prefix of the chat both as text and as tokens, or the loss mask would be wrong.
    """
    prompts = [
        tokenizer.apply_chat_template(
            chat_messages(e, with_answer=False),
            add_generation_prompt=True,
            enable_thinking=True,
            tokenize=False,
        )
        for e in examples
    ]
    chats = [
        tokenizer.apply_chat_template(chat_messages(e, with_answer=True), tokenize=False)
        for e in examples
    ]
    # The template ends a chat with "<|im_end|>\n"; the model is taught to stop at <|im_end|>.
    chats = [chat[: chat.rindex(END_OF_TURN) + len(END_OF_TURN)] for chat in chats]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    chat_ids = tokenizer(chats, add_special_tokens=False)["input_ids"]
    encoded = []
    for example, prompt, chat, ids, full in zip(examples, prompts, chats, prompt_ids, chat_ids):
        if not chat.startswith(prompt) or full[: len(ids)] != ids:
            raise ValueError(f"chat template: prompt is not a prefix of the chat for {example}")
        encoded.append((full, len(ids)))
    return encoded


def pack_batch(
    encoded: list[tuple[list[int], int]], row_tokens: int, pad_id: int
) -> tuple[Any, Any, Any]:
    """Pack examples into rows of at most `row_tokens` tokens (one row per example if longer).

    Returns input ids, position ids (restarting at 0 for each example, which makes transformers
    mask attention between examples of a row) and labels (-100 on prompts and padding). Packing
    instead of padding every example to the longest one nearly halves the compute per step.
    """
    import torch

    rows: list[list[tuple[list[int], int]]] = [[]]
    used = 0
    for ids, prompt_len in encoded:
        if rows[-1] and used + len(ids) > row_tokens:
            rows.append([])
            used = 0
        rows[-1].append((ids, prompt_len))
        used += len(ids)
    width = max(sum(len(ids) for ids, _ in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for r, row in enumerate(rows):
        offset = 0
        for ids, prompt_len in row:
            end = offset + len(ids)
            input_ids[r, offset:end] = torch.tensor(ids)
            position_ids[r, offset:end] = torch.arange(len(ids))
            labels[r, offset + prompt_len : end] = torch.tensor(ids[prompt_len:])
            offset = end
        # Padding at the end of a row is one more "sequence" of its own, never a label.
        position_ids[r, offset:] = torch.arange(width - offset)
    return input_ids, position_ids, labels


def _lr_factor(step: int, total_steps: int, warmup_steps: int) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


WINDOW_CONTEXT_TOKENS = 32  # a window's first tokens lack the line before: not trained on
ANSWER_HEAD_TOKENS = 16  # every row keeps the answer's start (`<think>` and its first line)


def window_rows(
    encoded: list[tuple[list[int], int]], window_tokens: int, rng: random.Random
) -> list[tuple[list[int], list[int], list[bool]]]:
    """Each example as its prompt, the head of its answer and one window of `window_tokens`
    answer tokens, kept at their true positions: (ids, position ids, which tokens are trained).

    A long answer costs a window's compute instead of its whole length, while RoPE still sees
    the window's real distance to the prompt (where the count's end or the list is). Every row
    keeps the answer's first tokens, so the model learns how an answer starts as often as a
    whole-example batch teaches it; a quarter of the windows end the answer (where it stops).
    """
    rows = []
    for ids, prompt_len in encoded:
        head_end = prompt_len + ANSWER_HEAD_TOKENS
        if len(ids) - head_end <= window_tokens:
            rows.append((ids, list(range(len(ids))), [i >= prompt_len for i in range(len(ids))]))
            continue
        last_start = len(ids) - window_tokens
        start = last_start if rng.random() < 0.25 else rng.randint(head_end, last_start)
        kept = [*range(head_end), *range(start, start + window_tokens)]
        trained = [prompt_len <= i < head_end for i in range(head_end)]
        # A window right after the head continues it; a detached one first needs a line back.
        trained += [start == head_end or j >= WINDOW_CONTEXT_TOKENS for j in range(window_tokens)]
        rows.append(([ids[i] for i in kept], kept, trained))
    return rows


def pad_rows(rows: list[tuple[list[int], list[int], list[bool]]], pad_id: int) -> dict[str, Any]:
    """Right-padded input ids, attention mask, position ids and labels of window rows. The mask
    is given, so transformers takes the jump in positions for RoPE, not for a packed sequence."""
    import torch

    width = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for r, (ids, positions, trained) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attention_mask[r, : len(ids)] = 1
        position_ids[r, : len(ids)] = torch.tensor(positions)
        labels[r, : len(ids)] = torch.where(torch.tensor(trained), torch.tensor(ids), -100)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "labels": labels,
    }


def train_model(
    model: Any,
    tokenizer: Any,
    examples: list[DemoExample],
    *,
    train_steps: int,
    batch_size: int,
    learning_rate: float,
    window_tokens: int | None = None,
) -> float:
    """Train for exactly `train_steps` steps (AdamW, warmup + cosine); return the final loss
    (an average over the last ten or so steps, so one lucky batch does not decide it).
    `window_tokens`: train on windows of long answers (window_rows) instead of whole ones."""
    import torch
    from tqdm import tqdm

    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.01
    )
    warmup_steps = max(1, min(100, train_steps // 10))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, train_steps, warmup_steps)
    )
    model.train()
    loss_ema = float("nan")
    progress = tqdm(range(train_steps), desc="train demo target", file=sys.stderr, mininterval=2)
    for step in progress:
        # Encoded step by step: the tokenizer's cost hides among the steps, memory stays flat.
        chunk = encode_training_batch(
            tokenizer, examples[step * batch_size : (step + 1) * batch_size]
        )
        if window_tokens:
            rows = window_rows(chunk, window_tokens, random.Random(f"window-{step}"))
            loss = model(**pad_rows(rows, pad_id), use_cache=False).loss
        else:
            input_ids, position_ids, labels = pack_batch(chunk, ROW_TOKENS, pad_id)
            # No cache: transformers builds the per-example (packed) attention mask only without
            # one.
            loss = model(
                input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False
            ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        loss_ema = value if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * value
        progress.set_postfix(loss=f"{loss_ema:.3f}", refresh=False)
    progress.close()
    model.eval()
    return loss_ema
