"""A tiny tokenizer for tests: a byte-level BPE trained here with `tokenizers` on a few lines,
with Qwen-like special tokens, think tokens and a Qwen3-shaped chat template, saved in Hugging Face
layout."""

from __future__ import annotations

from pathlib import Path

THINK_START, THINK_END, END_OF_TURN = "<think>", "</think>", "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", END_OF_TURN)

# Qwen3's shape: history turns, then the assistant header; the model writes <think> itself.
QWEN3_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)

# What the BPE is trained on: the shapes of prompts, reasoning and answers the tests use.
CORPUS = [
    "What is 2 + 2? Think step by step.",
    "\nFirst add the units: 2 + 2 = 4.\nSo the answer is 4.\n",
    "\n\nThe answer is **4**.",
    " 2 + 2 = **4**",
    "Count the letters in banana, then sort them.",
    "user\nassistant\nsystem\n",
] * 20


def make_tokenizer(
    out_dir: Path,
    chat_template: str = QWEN3_TEMPLATE,
    think_tokens: bool = True,
    nfc: bool = False,
) -> Path:
    """A byte-level BPE tokenizer with Qwen-like added tokens, saved in Hugging Face layout."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    if nfc:  # as Qwen's tokenizers: text is NFC-normalised before it is split
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    if think_tokens:
        tokenizer.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t in (THINK_START, THINK_END)]
        )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TURN,
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        chat_template=chat_template,
    ).save_pretrained(out_dir)
    return out_dir
