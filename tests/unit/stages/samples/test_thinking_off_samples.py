"""Samples generated with thinking switched off (Qwen3 `enable_thinking: false`, Kimi-K2.5
`thinking: false`) are kept and trained on: validation keeps their empty reasoning (the hard stop
counts only rows asked with thinking on), the samples schema takes them only from such requests,
and tokenize writes the content and end of turn after the template's closed think block, the very
sequence the demo's templates render for the whole conversation with the switch off (the server's
content-only ids accepted and agreeing with the rebuild)."""

import json
from pathlib import Path

import pandera.errors
import polars as pl
import pytest
from support.frames import prompt_frame, raw_row, sample, sample_id, samples_frame
from support.tiny_tokenizer import END_OF_TURN, make_tokenizer

import eaglenest.demo
from eaglenest.common.config import validate_config
from eaglenest.formats.raw import RAW_SCHEMA
from eaglenest.settings.probe import ProbeSettings
from eaglenest.settings.samples import TokenizeSettings, ValidationSettings
from eaglenest.stages.probe import probe_think_ids
from eaglenest.stages.samples.server_ids import server_text_check
from eaglenest.stages.samples.tokenize import tokenize_samples
from eaglenest.stages.samples.validate import ShardValidationError, validate_frame

DEMO = Path(eaglenest.demo.__file__).parent
PROBE = {"reasoning_field": "reasoning", "token_ids": {"supported": True}}
STRICT = ValidationSettings(
    max_empty_reasoning_fraction=0.0, max_truncated_fraction=0.1, max_bad_token_ids_fraction=0.0
)
ON, OFF = {"enable_thinking": True}, {"enable_thinking": False}


def raw_frame(kwargs: list[dict], reasoned: list[bool]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Raw answers to prompts asked with `kwargs`, with reasoning or (as a server answers
    thinking off) without it."""
    prompts = prompt_frame(len(kwargs))
    rows = [
        raw_row(
            i,
            request=json.dumps({"chat_template_kwargs": k, "messages": []}, sort_keys=True),
            **({} if r else {"reasoning": "", "reasoning_field": "none", "content": "42"}),
        )
        for i, k, r in zip(prompts["id"].to_list(), kwargs, reasoned)
    ]
    return pl.DataFrame(rows, schema=RAW_SCHEMA), prompts


def test_answers_asked_with_thinking_off_are_kept_without_reasoning():
    raw, prompts = raw_frame([OFF, OFF, ON], [False, False, True])
    samples, report = validate_frame(raw, prompts, PROBE, STRICT, "00000")
    assert samples["reasoning"].to_list() == ["", "", "\nthink\n"]
    assert samples["reasoning_field"].to_list() == ["none", "none", "reasoning"]
    assert samples["thinking_switch"].to_list() == [False, False, True]
    assert samples["thinking"].to_list() == [False, False, True]
    assert report["dropped"] == {} and report["thinking"]["mode"] == "mixed"


def test_the_empty_reasoning_stop_counts_only_rows_asked_with_thinking_on():
    raw, prompts = raw_frame([OFF, OFF, OFF, ON, ON], [False, False, False, False, True])
    lenient = ValidationSettings(
        max_empty_reasoning_fraction=0.5, max_truncated_fraction=0.1, max_bad_token_ids_fraction=0
    )
    # 1 of 2 asked on is empty: at the threshold, not over it (1 of 5 answered, before).
    samples, report = validate_frame(raw, prompts, PROBE, lenient, "00000")
    assert samples.height == 4 and report["dropped"] == {"empty_reasoning": 1}
    raw, prompts = raw_frame([OFF, OFF, OFF, ON], [False, False, False, False])
    with pytest.raises(ShardValidationError) as err:
        validate_frame(raw, prompts, PROBE, lenient, "00000")
    message = str(err.value)
    assert "1 of 1 answered rows have empty reasoning (of those asked with thinking on" in message
    assert "3 more were asked with thinking off" in message


@pytest.mark.parametrize("kwargs", [ON, None], ids=["switch-on", "no-switch"])
def test_the_samples_schema_takes_empty_reasoning_only_from_thinking_off(kwargs):
    samples_frame([sample("q", "", "4", kwargs=OFF)])
    with pytest.raises(pandera.errors.SchemaError, match="unless the request switched thinking"):
        samples_frame([sample("q", "", "4", kwargs=kwargs)])


@pytest.mark.parametrize(
    ("template", "switch", "prompt_end"),
    [
        ("chat_template.jinja", "enable_thinking", "<think>\n\n</think>\n\n"),
        ("kimi_chat_template.jinja", "thinking", "<think></think>"),
    ],
)
def test_thinking_off_tokens_are_the_templates_rendering_of_the_conversation(
    tmp_path, template, switch, prompt_end
):
    from transformers import AutoTokenizer

    tokenizer_dir = make_tokenizer(tmp_path / "tok", (DEMO / template).read_text())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    off = {switch: False}
    config = validate_config({"target": {"path": str(tokenizer_dir), "chat_template_kwargs": off}})
    history = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "2"},
    ]
    row = sample("What is 2 + 2?", "", "4", history=history, kwargs=off)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = tokenizer.apply_chat_template(
        row["messages"], add_generation_prompt=True, tokenize=False, **off
    )
    assert prompt.endswith("<|im_start|>assistant\n" + prompt_end)
    # What a server returns: the prompt it rendered, and the model's content and end of turn.
    server_row = dict(
        row,
        id=sample_id("server"),
        prompt_token_ids=encode(prompt),
        completion_token_ids=encode("4" + END_OF_TURN),
        token_layout="vllm",
    )
    think_ids = probe_think_ids(ProbeSettings.from_config(config))
    frame, _, report = tokenize_samples(
        samples_frame([row, server_row]), TokenizeSettings.from_config(config), think_ids
    )
    whole = tokenizer.apply_chat_template(
        [*row["messages"], {"role": "assistant", "content": "4"}], tokenize=False, **off
    )
    # The template ends the turn with a newline the model does not write.
    expected = encode(whole.removesuffix("\n"))
    assert frame["token_source"].to_list() == ["rebuilt", "server"]
    assert frame["input_ids"].to_list() == [expected, expected]
    assert frame["prompt_len"].to_list() == [len(encode(prompt))] * 2
    assert frame["thinking"].to_list() == [False, False]
    assert report["prompt_closes_think_block"] == 2 and report["prompt_opens_think_block"] == 0
    assert report["server_ids_text_mismatch"] == 0 and report["agreement"]["share"] == 1.0
    assert report["thinking"]["mode"] == "off"


def test_reasoning_after_a_closed_think_block_does_not_decode_back(tmp_path):
    """A template that closed the think block leaves reasoning nowhere to go: such a sample is
    dropped, not written with a second think block."""
    tokenizer_dir = make_tokenizer(tmp_path / "tok", (DEMO / "chat_template.jinja").read_text())
    config = validate_config({"target": {"path": str(tokenizer_dir), "chat_template_kwargs": OFF}})
    row = sample("What is 2 + 2?", "\nadd\n", "4", kwargs=OFF)
    think_ids = probe_think_ids(ProbeSettings.from_config(config))
    frame, _, report = tokenize_samples(
        samples_frame([row]), TokenizeSettings.from_config(config), think_ids
    )
    assert frame.height == 0 and report["dropped_rebuild_decode_mismatch"] == 1


def test_server_ids_of_an_answer_without_reasoning_hold_its_content_alone():
    assert server_text_check("4<|im_end|>", "", "</think>", "4") == ""
    assert server_text_check("5<|im_end|>", "", "</think>", "4") is None
    # Reasoning the text lost: the ids hold a think block the sample has no reasoning for.
    assert server_text_check("x</think>\n4<|im_end|>", "", "</think>", "4") is None
