"""The demo target's tokenizer: a byte-level BPE with Qwen2's pre-tokenizer, trained on the demo
tasks, with Qwen3's special tokens, think tags and chat template (chat_template.jinja)."""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources
from typing import Any

from eaglenest.common.reasoning import THINK_END, THINK_START
from eaglenest.demo.example import DemoExample
from eaglenest.demo.tasks import END_OF_TURN, PAD_TOKEN

IM_START = "<|im_start|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, END_OF_TURN)
THINK_TOKENS = (THINK_START, THINK_END)
# Qwen2/Qwen3's pre-tokenizer split: single digits (`\p{N}`), so numbers are digit sequences.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TOKENIZER_CORPUS_EXAMPLES = 4000


def chat_template() -> str:
    return resources.files("eaglenest.demo").joinpath("chat_template.jinja").read_text()


def build_demo_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """Train a byte-level BPE on `texts` with Qwen2's pre-tokenizer; return a fast HF tokenizer.

    `vocab_size` counts the five added tokens too. Like Qwen3, `<|endoftext|>` (pad),
    `<|im_start|>` and `<|im_end|>` (eos) are special and `<think>`/`</think>` are not, so the
    think tags survive `decode(..., skip_special_tokens=True)`.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    n_added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # Added after training so they take the last ids, as in Qwen's vocabularies.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TURN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        padding_side="left",
        model_max_length=4096,
        chat_template=chat_template(),
    )


def tokenizer_corpus(examples: list[DemoExample]) -> Iterable[str]:
    # Raw texts, not rendered chats: the chat markers are added tokens, never BPE-merged.
    yield "user\nassistant\nsystem\n"
    for example in examples:
        yield example.prompt
        yield example.reasoning
        # The answer follows "</think>\n\n" in a chat: let BPE learn the double newline too.
        yield "\n\n" + example.answer
