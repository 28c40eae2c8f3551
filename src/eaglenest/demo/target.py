"""Build the embedded demo target: a tiny Qwen3-architecture reasoning model trained on CPU.

The demo pipeline needs a target that behaves like a real reasoning model where it matters to
eaglenest: its own byte-level BPE tokenizer with Qwen's pre-tokenizer, `<think>`/`</think>` as
single added tokens, a Qwen3-style chat template, and completions of the form
`<think>\\n...\\n</think>\\n\\nanswer<|im_end|>`. It is trained here from scratch on the synthetic
tasks of `eaglenest.demo.tasks` for a fixed number of steps (deterministic for a seed), evaluated
on held-out prompts, and saved in Hugging Face layout so the server, the tokenizer-based stages
and the hidden-state stage load it like any other checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from eaglenest.client.reasoning import THINK_END, THINK_START, split_think
from eaglenest.common.io import held_temp_beside, write_json
from eaglenest.demo.tasks import (
    END_OF_TURN,
    PAD_TOKEN,
    TASK_FAMILIES,
    DemoExample,
    check_answer,
    heldout_examples,
    is_well_formed,
    training_examples,
)

logger = logging.getLogger(__name__)

IM_START = "<|im_start|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, END_OF_TURN)
THINK_TOKENS = (THINK_START, THINK_END)
# Qwen2/Qwen3's pre-tokenizer split: single digits (`\p{N}`), so numbers are digit sequences.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
METRICS_FILE = "demo_metrics.json"
MAX_NEW_TOKENS = 128
TOKENIZER_CORPUS_EXAMPLES = 4000
ROW_TOKENS = 256  # packed training row length; short rows keep attention cost small


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


def chat_messages(example: DemoExample, with_answer: bool) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": example.prompt}]
    if with_answer:
        messages.append(
            {"role": "assistant", "content": example.answer, "reasoning_content": example.reasoning}
        )
    return messages


def _tokenizer_corpus(examples: list[DemoExample]) -> Iterable[str]:
    # Raw texts, not rendered chats: the chat markers are added tokens, never BPE-merged.
    yield "user\nassistant\nsystem\n"
    for example in examples:
        yield example.prompt
        yield example.reasoning
        # The answer follows "</think>\n\n" in a chat: let BPE learn the double newline too.
        yield "\n\n" + example.answer


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


# DeepSeek-V3's shape (Kimi-K2, Kimi-K2.5) at the sizes vLLM's CPU kernels take: MLA with a
# latent of kv_lora_rank 512 + qk_rope_head_dim 64 (CPU MLA's only head size), hidden and expert
# sizes that are multiples of 32 (its fused MoE), the first layer dense, then routed experts
# with one shared expert and DeepSeek-V3's sigmoid routing with a correction bias (noaux_tc).
DEEPSEEK_V3_DEFAULTS = {
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
ARCHITECTURES = ("qwen3", "deepseek_v3")


def _qwen3_config(shared: dict[str, Any], num_kv_heads: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        **shared,
        num_key_value_heads=num_kv_heads,
        head_dim=shared["hidden_size"] // shared["num_attention_heads"],
        tie_word_embeddings=True,
    )


def _deepseek_v3_config(shared: dict[str, Any], deepseek_v3: dict[str, Any]) -> Any:
    from transformers import DeepseekV3Config

    sizes = {**DEEPSEEK_V3_DEFAULTS, **deepseek_v3}
    return DeepseekV3Config(
        **shared,
        **sizes,
        num_key_value_heads=shared["num_attention_heads"],
        n_group=1,  # one expert group: group-limited routing needs more experts than a demo has
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        # As DeepSeek-V3's and Kimi-K2's config.json say it: transformers implies both, but
        # vLLM reads them (without topk_method it has no correction bias to load).
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        rope_interleave=True,  # as DeepSeek's checkpoints (and their reference code) rotate
        tie_word_embeddings=False,  # a separate LM head, as in DeepSeek-V3 and Kimi-K2.5
    )


def _make_model(
    tokenizer: Any,
    *,
    architecture: str,
    vocab_size: int,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    deepseek_v3: dict[str, Any] | None = None,
) -> Any:
    from transformers import DeepseekV3ForCausalLM, Qwen3ForCausalLM

    if architecture not in ARCHITECTURES:
        raise ValueError(f"demo_target.architecture {architecture!r}: one of {ARCHITECTURES}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    shared = {
        # Like Qwen's checkpoints, the embedding may have more rows than the tokenizer has
        # tokens; later stages must size things by config.vocab_size, and this keeps them honest.
        "vocab_size": max(vocab_size, len(tokenizer)),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "max_position_embeddings": 1024,
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        "eos_token_id": tokenizer.convert_tokens_to_ids(END_OF_TURN),
        "bos_token_id": None,
        "use_cache": True,
    }
    if architecture == "qwen3":
        return Qwen3ForCausalLM(_qwen3_config(shared, num_kv_heads))
    return DeepseekV3ForCausalLM(_deepseek_v3_config(shared, deepseek_v3 or {}))


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


def train_model(
    model: Any,
    tokenizer: Any,
    examples: list[DemoExample],
    *,
    train_steps: int,
    batch_size: int,
    learning_rate: float,
) -> float:
    """Train for exactly `train_steps` steps (AdamW, warmup + cosine); return the final loss
    (an average over the last ten or so steps, so one lucky batch does not decide it)."""
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
        input_ids, position_ids, labels = pack_batch(chunk, ROW_TOKENS, pad_id)
        # No cache: transformers builds the per-example (packed) attention mask only without one.
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


def generate_completions(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    batch_size: int = 64,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[str]:
    """Greedy completions (decoded with special tokens kept) for user `prompts`."""
    import torch

    eos_ids = [
        tokenizer.convert_tokens_to_ids(END_OF_TURN),
        tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    ]
    pad_id = eos_ids[1]
    completions: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chats = [[{"role": "user", "content": p}] for p in prompts[start : start + batch_size]]
        rendered = [
            tokenizer.apply_chat_template(
                c, add_generation_prompt=True, enable_thinking=True, tokenize=False
            )
            for c in chats
        ]
        inputs = tokenizer(
            rendered,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        )
        with torch.inference_mode():
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_ids,
                pad_token_id=pad_id,
            )
        for row in output[:, inputs["input_ids"].shape[1] :].tolist():
            # Rows that stopped early are padded to the longest one: cut after the first eos.
            stop = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
            completions.append(tokenizer.decode(row[:stop], skip_special_tokens=False))
    return completions


def evaluate_model(model: Any, tokenizer: Any, examples: list[DemoExample]) -> dict[str, Any]:
    """Share of well-formed think blocks and of correct answers, overall and per family."""
    completions = generate_completions(model, tokenizer, [e.prompt for e in examples])
    well_formed, correct, reasoned = [], [], []
    per_family: dict[str, list[bool]] = {family: [] for family in TASK_FAMILIES}
    for example, completion in zip(examples, completions):
        ok_form = is_well_formed(completion)
        reasoning, content = split_think(completion)
        reasoned.append(bool(reasoning and reasoning.strip()))
        if content is not None:
            content = content.split(END_OF_TURN)[0]
        ok_answer = ok_form and check_answer(example, content)
        well_formed.append(ok_form)
        correct.append(ok_answer)
        per_family[example.family].append(ok_answer)
    n = max(1, len(examples))
    return {
        "heldout_prompts": len(examples),
        "well_formed_share": sum(well_formed) / n,
        "reasoning_share": sum(reasoned) / n,
        "correct_share": sum(correct) / n,
        "correct_share_per_family": {
            family: (sum(v) / len(v) if v else None) for family, v in per_family.items()
        },
        "sample_completions": [
            {"prompt": e.prompt, "completion": c} for e, c in list(zip(examples, completions))[:5]
        ],
    }


class DemoTargetError(RuntimeError):
    """The demo target was built but cannot stand in for a reasoning model."""


def check_reasoning_share(metrics: dict[str, Any], minimum: float, train_steps: int) -> None:
    """Fail the build when too few held-out prompts get reasoning: every later stage (and the
    probe first) would stop on such a target, after minutes of work instead of now."""
    share = metrics["reasoning_share"]
    if share >= minimum:
        return
    n = metrics["heldout_prompts"]
    examples = "; ".join(repr(s["completion"][:120]) for s in metrics["sample_completions"][:2])
    raise DemoTargetError(
        f"the demo target answered {round(share * n)} of {n} held-out prompts with a non-empty "
        f"think block (share {share:.2f} < demo_target.min_reasoning_share {minimum}); it does "
        f"not reason reliably yet. Raise demo_target.train_steps (now {train_steps}) or change "
        f"demo_target.seed. First completions: {examples}"
    )


def _save(model: Any, tokenizer: Any, directory: Path) -> None:
    from transformers import GenerationConfig

    eos_ids = [
        tokenizer.convert_tokens_to_ids(END_OF_TURN),
        tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    ]
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[1],
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Use `threads` torch threads (else $EAGLENEST_THREADS, else torch's current setting) for
    the block, then restore the previous setting so a caller's process (a test session, say)
    is left as it was. Yields the number in use."""
    import torch

    previous = torch.get_num_threads()
    wanted = threads or int(os.environ.get("EAGLENEST_THREADS") or 0) or previous
    torch.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; it replaces `path` only if the block succeeds,
    so a killed or failed build never leaves a directory that looks complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Made like mkdir makes it (mkdtemp: 0700); stale ones of killed builds are removed first.
    with held_temp_beside(path, directory=True) as tmp:
        try:
            yield tmp
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)


def _parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def _train_and_evaluate(
    model: Any,
    tokenizer: Any,
    examples: list[DemoExample],
    *,
    seed: int,
    train_steps: int,
    batch_size: int,
    learning_rate: float,
    heldout_prompts: int,
    threads: int,
) -> dict[str, Any]:
    """Train `model` on `examples`, evaluate it on `heldout_prompts` held-out prompts; return the
    evaluation's metrics and how the target was made (seed, steps, parameters, final loss,
    seconds, threads, think token ids)."""
    train_started = time.perf_counter()
    final_loss = train_model(
        model,
        tokenizer,
        examples,
        train_steps=train_steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
    )
    train_seconds = time.perf_counter() - train_started
    eval_started = time.perf_counter()
    metrics = evaluate_model(model, tokenizer, heldout_examples(seed, heldout_prompts))
    metrics.update(
        architecture=model.config.model_type,
        seed=seed,
        train_steps=train_steps,
        batch_size=batch_size,
        n_params=_parameter_count(model),
        final_loss=final_loss,
        train_seconds=train_seconds,
        eval_seconds=time.perf_counter() - eval_started,
        threads=threads,
        think_token_ids=[tokenizer.convert_tokens_to_ids(t) for t in THINK_TOKENS],
    )
    return metrics


def build_demo_target(
    out_dir: str | Path,
    *,
    seed: int = 0,
    architecture: str = "qwen3",
    num_layers: int = 8,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    vocab_size: int = 1024,
    train_steps: int = 600,
    batch_size: int = 16,
    learning_rate: float = 3e-3,
    heldout_prompts: int = 60,
    min_reasoning_share: float = 0.9,
    deepseek_v3: dict[str, Any] | None = None,
    threads: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build, train, evaluate and save the demo target to `out_dir`; return its metrics.

    The defaults train on 9,600 examples: about 2 minutes on two idle cores (~85 examples/s),
    after which held-out completions are well-formed think blocks. The directory appears only
    when complete, and replaces an existing one. `threads`: see `torch_threads`; in a pipeline
    job the adapter has already set the rule's threads. `architecture`: qwen3 (dense) or
    deepseek_v3 (MLA + MoE, sized by `deepseek_v3` over DEEPSEEK_V3_DEFAULTS; `num_kv_heads`
    unused).
    """
    import torch

    say = log or logger.info
    started = time.perf_counter()
    with torch_threads(threads) as threads_used:
        torch.manual_seed(seed)
        examples = training_examples(seed, train_steps * batch_size)
        tokenizer = build_demo_tokenizer(
            _tokenizer_corpus(examples[:TOKENIZER_CORPUS_EXAMPLES]), vocab_size
        )
        model = _make_model(
            tokenizer,
            architecture=architecture,
            deepseek_v3=deepseek_v3,
            vocab_size=vocab_size,
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            intermediate_size=intermediate_size,
        )
        say(
            f"demo target ({architecture}): {len(tokenizer)} tokens, "
            f"{_parameter_count(model)} parameters; "
            f"{train_steps} steps of {batch_size} examples on {threads_used} threads"
        )
        metrics = _train_and_evaluate(
            model,
            tokenizer,
            examples,
            seed=seed,
            train_steps=train_steps,
            batch_size=batch_size,
            learning_rate=learning_rate,
            heldout_prompts=heldout_prompts,
            threads=threads_used,
        )
    say(
        f"held-out: well-formed {metrics['well_formed_share']:.2f}, "
        f"reasoning {metrics['reasoning_share']:.2f}, "
        f"correct {metrics['correct_share']:.2f}, final loss {metrics['final_loss']:.3f}"
    )
    check_reasoning_share(metrics, min_reasoning_share, train_steps)
    with atomic_directory(Path(out_dir)) as tmp_dir:
        _save(model, tokenizer, tmp_dir)
        metrics["total_seconds"] = time.perf_counter() - started
        write_json(tmp_dir / METRICS_FILE, metrics)
    say(f"demo target written to {out_dir} in {metrics['total_seconds']:.0f} s")
    return metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory (Hugging Face layout)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="qwen3")
    parser.add_argument("--train-steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=384)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--heldout-prompts", type=int, default=60)
    parser.add_argument(
        "--min-reasoning-share",
        type=float,
        default=0.9,
        help="fail when fewer held-out answers than this reason (0 turns the check off)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: $EAGLENEST_THREADS, else all cores)",
    )


def run(args: argparse.Namespace) -> int:
    build_demo_target(
        args.out,
        seed=args.seed,
        architecture=args.architecture,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        train_steps=args.train_steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        heldout_prompts=args.heldout_prompts,
        min_reasoning_share=args.min_reasoning_share,
        threads=args.threads,
    )
    return 0
