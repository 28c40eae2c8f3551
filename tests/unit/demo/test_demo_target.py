"""Tests of the embedded demo target: synthetic tasks, tokenizer, chat template, build."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from eaglenest.common.config import settings_from_sections
from eaglenest.demo.target import DEMO_METRICS_FILE, build_demo_target
from eaglenest.demo.target_tokenizer import build_demo_tokenizer
from eaglenest.demo.tasks import (
    TASK_FAMILIES,
    DemoExample,
    check_answer,
    heldout_examples,
    is_heldout_prompt,
    is_well_formed,
    make_example,
    training_examples,
)
from eaglenest.settings.demo_target import DemoTargetSettings


def demo_settings(**values) -> DemoTargetSettings:
    """The demo target's settings: these values over the `demo_target` section's defaults."""
    return settings_from_sections(DemoTargetSettings, demo_target=values)


TINY_BUILD = {
    "num_layers": 4,  # the schema's least: three aux layers and the last
    "hidden_size": 32,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "vocab_size": 400,
    "batch_size": 8,
    "heldout_prompts": 5,
}


@pytest.fixture(scope="module")
def tokenizer():
    examples = training_examples(0, 500)
    texts = [t for e in examples for t in (e.prompt, e.reasoning, "\n\n" + e.answer)]
    return build_demo_tokenizer(texts, vocab_size=400)


# --- tasks ---------------------------------------------------------------------------------------


def test_tasks_are_deterministic_for_a_seed():
    assert training_examples(3, 40) == training_examples(3, 40)
    assert heldout_examples(3, 40) == heldout_examples(3, 40)
    assert training_examples(3, 40) != training_examples(4, 40)
    rng_a, rng_b = random.Random(7), random.Random(7)
    for family in TASK_FAMILIES:
        assert make_example(rng_a, family) == make_example(rng_b, family)


def test_training_and_heldout_are_disjoint_and_heldout_scales():
    heldout = heldout_examples(0, 3000)
    prompts = {e.prompt for e in heldout}
    assert len(prompts) == 3000  # distinct
    assert all(is_heldout_prompt(p) for p in prompts)
    training = training_examples(0, 5000)
    assert not prompts & {e.prompt for e in training}
    # Another seed's training set never contains this seed's held-out prompts either.
    assert not prompts & {e.prompt for e in training_examples(1, 5000)}


def test_families_round_robin_and_reasoning_shape():
    examples = training_examples(0, 3 * len(TASK_FAMILIES))
    assert [e.family for e in examples] == list(TASK_FAMILIES) * 3
    assert len(TASK_FAMILIES) >= 4
    for e in examples:
        assert e.reasoning.startswith("\n") and e.reasoning.endswith("\n")
        assert e.reasoning.strip() and e.answer and e.prompt


def test_answers_are_right():
    rng = random.Random(0)
    for _ in range(100):
        add = make_example(rng, "addition")
        a, b = (int(x) for x in add.prompt.removeprefix("What is ").rstrip("?").split(" + "))
        assert add.answer == str(a + b) and add.reasoning.endswith(f"={a + b}\n")
        sort = make_example(rng, "sort")
        numbers = [int(x) for x in sort.prompt.removeprefix("Sort ascending: ").split(", ")]
        assert sort.answer == ", ".join(map(str, sorted(numbers)))
        compare = make_example(rng, "compare")
        a, b = (int(x) for x in compare.prompt.removeprefix("Which is larger, ")[:-1].split(" or "))
        assert a != b and compare.answer == str(max(a, b))
        count = make_example(rng, "count_letter")
        letter, word = count.prompt.removeprefix("How many times does the letter ")[:-1].split(
            " appear in "
        )
        assert count.answer == str(word.count(letter))
        parity = make_example(rng, "parity")
        n = int(parity.prompt.split()[1])
        assert parity.answer == ("even" if n % 2 == 0 else "odd")


def test_check_answer_and_well_formed():
    example = DemoExample("addition", "What is 2 + 3?", "\n2+3+0=5\n", "5")
    assert check_answer(example, "5") and check_answer(example, " 5\n")
    assert not check_answer(example, "6") and not check_answer(example, None)
    assert is_well_formed("<think>\n2+3=5\n</think>\n\n5<|im_end|>")
    assert is_well_formed("<think>\n2+3=5\n</think>\n\n5<|im_end|><|endoftext|><|endoftext|>")
    for bad in [
        "<think>\n\n</think>\n\n5<|im_end|>",  # empty reasoning
        "<think>\n2+3=5\n</think>\n\n5",  # cut before end of turn
        "<think>\n2+3=5\n</think>\n\n<|im_end|>",  # no answer
        "<think>\na\n</think>\n\n<think>\nb\n</think>\n\n5<|im_end|>",  # two think blocks
        "<think>\n2+3=5\n5<|im_end|>",  # never closed
        "5<|im_end|>",  # no think block
        "<think>\n2+3=5\n</think>\n\n5<|im_end|>more",
    ]:
        assert not is_well_formed(bad), bad


# --- tokenizer and chat template -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["  leading spaces", "a\n\nb\n", "\n\n\nx  \t y\r\n", "What is 123 + 45?", "héllo ✓ 日本", ""],
)
def test_tokenizer_round_trips_text_exactly(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_think_and_chat_tokens_are_single_ids(tokenizer):
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<|im_end|>")}
    assert len(set(ids.values())) == 3 and all(isinstance(i, int) for i in ids.values())
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = "<think>\n1+2\n</think>\n\n3<|im_end|>"
    encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert encoded[0] == ids["<think>"] and ids["</think>"] in encoded
    assert encoded[-1] == ids["<|im_end|>"]
    # Like Qwen3: think tags are not special, so they survive skip_special_tokens.
    assert tokenizer.decode(encoded, skip_special_tokens=True) == "<think>\n1+2\n</think>\n\n3"
    # Digits are single tokens (Qwen's pre-tokenizer).
    assert len(tokenizer("12345", add_special_tokens=False)["input_ids"]) == 5


def test_chat_template_renders_qwen3_form(tokenizer):
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(
        user, add_generation_prompt=True, enable_thinking=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    no_think = tokenizer.apply_chat_template(
        user, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    assert no_think == prompt + "<think>\n\n</think>\n\n"
    answered = user + [{"role": "assistant", "content": "5", "reasoning_content": "\n2+3=5\n"}]
    chat = tokenizer.apply_chat_template(answered, tokenize=False)
    assert chat == prompt + "<think>\n2+3=5\n</think>\n\n5<|im_end|>\n"
    # Inline think tags in content are read like reasoning_content.
    inline = user + [{"role": "assistant", "content": "<think>\n2+3=5\n</think>\n\n5"}]
    assert tokenizer.apply_chat_template(inline, tokenize=False) == chat
    # Earlier assistant turns lose their reasoning; the one after the last user turn keeps it.
    two_turns = answered + [{"role": "user", "content": "Again?"}] + answered[1:]
    rendered = tokenizer.apply_chat_template(two_turns, tokenize=False)
    assert rendered.count("<think>") == 1
    assert rendered.startswith(prompt + "5<|im_end|>\n<|im_start|>user\nAgain?<|im_end|>\n")
    assert rendered.endswith("<|im_start|>assistant\n<think>\n2+3=5\n</think>\n\n5<|im_end|>\n")
    with_system = [{"role": "system", "content": "Be brief."}, *user]
    assert tokenizer.apply_chat_template(with_system, tokenize=False).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    )


# --- build ---------------------------------------------------------------------------------------


def test_quick_build_through_the_cli_loads_with_auto_classes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglenest.cli import main

    out = tmp_path / "target"
    args = ["build-demo-target", "--out", str(out), "--train-steps", "30", "--threads", "1"]
    args += ["--min-reasoning-share", "0"]  # 30 steps is not enough to reason
    for key, value in TINY_BUILD.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    assert main(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no temp dir left beside it

    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's private 0700
    assert (out / DEMO_METRICS_FILE).stat().st_mode & 0o777 == 0o666 & ~umask

    metrics = json.loads((out / DEMO_METRICS_FILE).read_text())
    assert metrics["train_steps"] == 30 and metrics["heldout_prompts"] == 5
    assert 0 <= metrics["well_formed_share"] <= 1 and metrics["n_params"] > 0
    assert set(metrics["correct_share_per_family"]) == set(TASK_FAMILIES)

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size >= len(tokenizer)
    im_end, pad = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert model.generation_config.eos_token_id == [im_end, pad]
    assert model.generation_config.pad_token_id == pad
    assert tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        enable_thinking=True,
        tokenize=False,
    ).endswith("<|im_start|>assistant\n")
    assert metrics["think_token_ids"] == tokenizer.convert_tokens_to_ids(["<think>", "</think>"])


def test_build_is_deterministic_and_failed_build_leaves_nothing(tmp_path, monkeypatch):
    import torch

    from eaglenest.demo import target as demo_target

    threads_before = torch.get_num_threads()
    # One thread: tiny models gain nothing from more, and the numbers are then reproducible.
    untrained = demo_settings(train_steps=3, min_reasoning_share=0.0, **TINY_BUILD)
    first = build_demo_target(tmp_path / "a", untrained, threads=1)
    second = build_demo_target(tmp_path / "b", untrained, threads=1)
    assert first["threads"] == 1 and torch.get_num_threads() == threads_before  # restored
    assert first["final_loss"] == second["final_loss"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(demo_target, "_save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        build_demo_target(tmp_path / "c", untrained, threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_a_demo_target_that_does_not_reason_fails_its_build(tmp_path):
    """Three training steps: the model cannot open a think block yet. The build says so and
    writes nothing, instead of letting the probe stop the run minutes later."""
    from eaglenest.demo.target_heldout import DemoTargetError

    with pytest.raises(DemoTargetError, match=r"min_reasoning_share 0\.9.*train_steps \(now 3\)"):
        build_demo_target(tmp_path / "t", demo_settings(train_steps=3, **TINY_BUILD), threads=1)
    assert not (tmp_path / "t").exists()


@pytest.mark.slow
def test_demo_target_fixture_emits_think_blocks(demo_target_dir: Path):
    metrics = json.loads((demo_target_dir / DEMO_METRICS_FILE).read_text())
    assert metrics["well_formed_share"] >= 0.8, metrics["sample_completions"]
    assert metrics["reasoning_share"] >= 0.9, metrics["sample_completions"]
