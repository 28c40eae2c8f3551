"""Tokenize: exact sequences with think tokens (server ids or rebuilt), loss masks, max_length.

Test tokenizers are byte-level BPEs trained here with `tokenizers`, with chat templates written
for the tests (Qwen3, Qwen3-Thinking / Kimi-K2.5 style prompts that open the think block,
DeepSeek-R1 style templates that drop reasoning from assistant turns). The demo test runs the
real demo target behind the real server and tokenizes what it generated.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from support.frames import sample, sample_id, samples_frame
from support.tiny_tokenizer import (
    END_OF_TURN,
    QWEN3_TEMPLATE,
    THINK_END,
    THINK_START,
    make_tokenizer,
)

from eaglenest.common.config import settings_from_sections, validate_config
from eaglenest.common.io import read_json, write_json
from eaglenest.formats.token_counts import read_token_counts
from eaglenest.formats.tokens import TokensSchema, loss_mask
from eaglenest.settings.probe import ProbeSettings
from eaglenest.settings.samples import TokenizeSettings
from eaglenest.stages.probe import probe_think_ids
from eaglenest.stages.samples.server_ids import MISMATCH_WINDOW
from eaglenest.stages.samples.tokenize import tokenize_samples, tokenize_shard
from eaglenest.target_model.remote_code import RemoteCodeError
from eaglenest.target_model.tokenizer import TokenizeError

# Qwen3-Thinking-2507 and DeepSeek-R1 (0528) end the prompt with "<think>\n", Kimi-K2.5 with
# "<think>": the model's output starts inside the think block.
THINKING_TEMPLATE = QWEN3_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' -}}", "{{- '<|im_start|>assistant\\n<think>\\n' -}}"
)
KIMI_STYLE_TEMPLATE = QWEN3_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' -}}", "{{- '<|im_start|>assistant<think>' -}}"
)
# DeepSeek-R1 style: assistant turns keep only what follows </think>, so rendering a whole
# conversation would lose the reasoning the model wrote.
R1_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1] + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def load(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def config_for(tokenizer_dir: Path, **tokenize) -> dict:
    return validate_config(
        {
            "target": {
                "path": str(tokenizer_dir),
                "chat_template_kwargs": {"enable_thinking": True},
            },
            "tokenize": tokenize,
        }
    )


def think_ids_of(config: dict) -> dict:
    """The think ids as the probe resolves them into probe.json, where tokenize reads them."""
    return probe_think_ids(ProbeSettings.from_config(config))


def tokenize(samples: pl.DataFrame, config: dict, shard: str = ""):
    """tokenize_samples as a samples job runs it on `config`: its settings, the probe's ids."""
    return tokenize_samples(
        samples, TokenizeSettings.from_config(config), think_ids_of(config), shard
    )


def write_probe(path: Path, config: dict) -> Path:
    write_json(path, {"think_token_ids": think_ids_of(config)})
    return path


def server_ids(tokenizer, sample_row: dict, generated_prefix: str = THINK_START) -> dict:
    """What a server returns for a model that wrote this answer with the tokenizer's own merges."""
    prompt = tokenizer.apply_chat_template(
        sample_row["messages"], add_generation_prompt=True, tokenize=False, enable_thinking=True
    )
    generated = (
        generated_prefix + sample_row["reasoning"] + THINK_END + sample_row["content"] + END_OF_TURN
    )
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    return dict(sample_row, prompt_token_ids=encode(prompt), completion_token_ids=encode(generated))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("qwen3-tokenizer"))


def rebuilt_completion_text(tokenizer, frame: pl.DataFrame, row: int = 0) -> str:
    ids = frame["input_ids"][row].to_list()
    return tokenizer.decode(ids[frame["prompt_len"][row] :], skip_special_tokens=False)


def test_leading_space_content_and_newline_reasoning_round_trip(qwen3_dir):
    reasoning = "\n\nFirst add the units: 2 + 2 = 4.\n\n"
    content = " 2 + 2 = **4**"
    frame, _, report = tokenize(
        samples_frame([sample("What is 2 + 2?", reasoning, content)]), config_for(qwen3_dir)
    )
    tokenizer = load(qwen3_dir)
    assert frame["token_source"].to_list() == ["rebuilt"]
    assert rebuilt_completion_text(tokenizer, frame) == (
        THINK_START + reasoning + THINK_END + content + END_OF_TURN
    )
    # Identical to the ids of the generated text tokenized as a whole (think tags are added
    # tokens, so no merge crosses them): what a server would have returned.
    expected = server_ids(tokenizer, sample("What is 2 + 2?", reasoning, content))
    assert frame["input_ids"][0].to_list() == (
        expected["prompt_token_ids"] + expected["completion_token_ids"]
    )
    assert report["dropped_rebuild_decode_mismatch"] == 0 and report["written"] == 1


def test_server_ids_are_used_and_compared_with_the_rebuild(qwen3_dir):
    tokenizer = load(qwen3_dir)
    rows = [
        server_ids(tokenizer, sample(f"What is {i} + 2?", f"\nadd {i}\n", f"\n\n{i + 2}"))
        for i in range(6)
    ]
    # One answer with a non-canonical tokenization (sampled token by token, as models can do):
    # the server's ids are kept, the rebuild disagrees, and the report shows where.
    odd = rows[5]
    completion = odd["completion_token_ids"]
    split_at = next(  # the first merged token of the reasoning (after <think>)
        k for k, i in enumerate(completion) if k > 0 and len(tokenizer.convert_ids_to_tokens(i)) > 1
    )
    as_bytes = tokenizer.convert_tokens_to_ids(
        list(tokenizer.convert_ids_to_tokens(completion[split_at]))
    )
    odd["completion_token_ids"] = completion[:split_at] + as_bytes + completion[split_at + 1 :]
    assert tokenizer.decode(odd["completion_token_ids"]) == tokenizer.decode(completion)
    frame, _, report = tokenize(samples_frame(rows), config_for(qwen3_dir))
    assert frame["token_source"].to_list() == ["server"] * 6
    assert frame["rebuild_agrees"].to_list() == [True] * 5 + [False]
    assert frame["input_ids"][5].to_list() == odd["prompt_token_ids"] + odd["completion_token_ids"]
    agreement = report["agreement"]
    assert (agreement["compared"], agreement["exact"]) == (6, 5)
    assert agreement["share"] == pytest.approx(5 / 6)
    assert (agreement["prompt_exact"], agreement["completion_exact"]) == (6, 5)
    assert agreement["retokenized"] == 1  # the same text in other ids, not a lost character
    [mismatch] = agreement["first_mismatches"]
    assert mismatch["id"] == odd["id"] and mismatch["part"] == "completion"
    assert mismatch["same_text"] is True
    assert mismatch["position"] == len(odd["prompt_token_ids"]) + split_at
    assert mismatch["server_ids"][MISMATCH_WINDOW : MISMATCH_WINDOW + 2] == as_bytes[:2]
    split_text = tokenizer.decode(as_bytes)  # the same text, in other ids
    assert split_text in mismatch["server_text"] and split_text in mismatch["rebuilt_text"]
    assert report["server_ids_text_mismatch"] == 0

    with pytest.raises(TokenizeError, match=r"agree with the server's for 5 of 6 samples"):
        tokenize(samples_frame(rows), config_for(qwen3_dir, min_agreement=0.9))


def test_server_text_that_its_ids_do_not_hold_is_reported(qwen3_dir):
    """A parser that strips whitespace: the ids are still what the model wrote (and are kept),
    but the text no longer matches them, so the report says so."""
    tokenizer = load(qwen3_dir)
    row = server_ids(tokenizer, sample("What is 2 + 2?", "\nadd\n", "\n\n4"))
    stripped = dict(row, reasoning="add", content="4")
    frame, _, report = tokenize(samples_frame([stripped]), config_for(qwen3_dir))
    assert frame["input_ids"][0].to_list() == row["prompt_token_ids"] + row["completion_token_ids"]
    assert report["server_ids_text_mismatch"] == 1 and report["agreement"]["exact"] == 0


def test_a_rebuild_that_does_not_decode_back_is_dropped(tmp_path):
    """An NFC-normalising tokenizer cannot encode a decomposed accent as written: without server
    ids the sample is dropped and counted; with them, the server's ids are kept."""
    tokenizer_dir = make_tokenizer(tmp_path / "tok", nfc=True)
    tokenizer = load(tokenizer_dir)
    decomposed = sample("Spell cafe\u0301.", "\nc-a-f-e\u0301\n", "\n\ncafe\u0301")
    plain = sample("What is 2 + 2?", "\nadd\n", "\n\n4")
    frame, _, report = tokenize(samples_frame([decomposed, plain]), config_for(tokenizer_dir))
    assert frame["id"].to_list() == [plain["id"]]
    assert report["dropped_rebuild_decode_mismatch"] == 1 == report["rebuild_decode_mismatch"]

    # What a model can emit: the decomposed text byte by byte, no normalisation on the way.
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str
    byte_ids = lambda text: tokenizer.convert_tokens_to_ids(
        [char for piece, _ in pieces(text) for char in piece]
    )
    think_start, think_end, end = tokenizer.convert_tokens_to_ids(
        [THINK_START, THINK_END, END_OF_TURN]
    )
    with_ids = server_ids(tokenizer, decomposed)
    with_ids["completion_token_ids"] = [
        think_start,
        *byte_ids(decomposed["reasoning"]),
        think_end,
        *byte_ids(decomposed["content"]),
        end,
    ]
    frame, _, report = tokenize(samples_frame([with_ids]), config_for(tokenizer_dir))
    assert frame["token_source"].to_list() == ["server"]
    assert report["rebuild_decode_mismatch"] == 1 and report["dropped_rebuild_decode_mismatch"] == 0
    assert report["server_ids_text_mismatch"] == 0 and report["agreement"]["exact"] == 0


def test_server_ids_without_end_of_turn_get_it_appended(qwen3_dir):
    tokenizer = load(qwen3_dir)
    row = server_ids(tokenizer, sample("What is 2 + 2?", "\nadd\n", "\n\n4"))
    row["completion_token_ids"] = row["completion_token_ids"][:-1]  # a server that drops the stop
    frame, _, report = tokenize(samples_frame([row]), config_for(qwen3_dir))
    assert frame["input_ids"][0].to_list()[-1] == tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert report["end_of_turn_appended"] == 1 and frame["rebuild_agrees"].to_list() == [True]


@pytest.mark.parametrize(
    "template, prompt_end", [(THINKING_TEMPLATE, "<think>\n"), (KIMI_STYLE_TEMPLATE, "<think>")]
)
def test_prompt_that_opens_the_think_block_gets_no_second_think(tmp_path, template, prompt_end):
    tokenizer_dir = make_tokenizer(tmp_path / "tok", template)
    tokenizer = load(tokenizer_dir)
    think_id = tokenizer.convert_tokens_to_ids(THINK_START)
    row = sample("What is 2 + 2?", "First add the units.\n", "\n\n4")
    server_row = server_ids(tokenizer, dict(row, id=sample_id("s")), generated_prefix="")
    frame, _, report = tokenize(samples_frame([row, server_row]), config_for(tokenizer_dir))
    for k in range(2):
        ids = frame["input_ids"][k].to_list()
        prompt_len = frame["prompt_len"][k]
        assert ids.count(think_id) == 1 and think_id in ids[:prompt_len]
        assert tokenizer.decode(ids[:prompt_len]).endswith(prompt_end)
        assert rebuilt_completion_text(tokenizer, frame, k) == (
            "First add the units.\n" + THINK_END + "\n\n4" + END_OF_TURN
        )
    assert report["prompt_opens_think_block"] == 2 and report["agreement"]["share"] == 1.0


def test_template_that_drops_reasoning_from_assistant_turns_keeps_it_in_the_sequence(tmp_path):
    tokenizer_dir = make_tokenizer(tmp_path / "tok", R1_TEMPLATE)
    tokenizer = load(tokenizer_dir)
    history = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "<think>\nearlier reasoning\n</think>\n\n2"},
    ]
    reasoning, content = "\nadd the units: 2 + 2 = 4\n", "\n\nThe answer is **4**."
    row = sample("And 2 + 2?", reasoning, content, history=history)
    # The template drops reasoning when it renders an assistant turn: a rebuild that rendered
    # the whole conversation would lose it.
    rendered = tokenizer.apply_chat_template(
        [
            *row["messages"],
            {"role": "assistant", "content": THINK_START + reasoning + THINK_END + content},
        ],
        tokenize=False,
    )
    assert reasoning not in rendered and "earlier reasoning" not in rendered
    frame, _, _ = tokenize(samples_frame([row]), config_for(tokenizer_dir))
    assert rebuilt_completion_text(tokenizer, frame) == (
        THINK_START + reasoning + THINK_END + content + END_OF_TURN
    )


def test_request_chat_template_kwargs_win_over_the_config(qwen3_dir):
    tokenizer = load(qwen3_dir)
    rows = [
        sample("What is 2 + 2?", "", "4", kwargs={"enable_thinking": False}),
        sample("What is 2 + 3?", "\nadd\n", "\n\n5"),  # no kwargs in the request: the config's
    ]
    frame, _, _ = tokenize(samples_frame(rows), config_for(qwen3_dir))
    prompts = [
        tokenizer.decode(frame["input_ids"][k].to_list()[: frame["prompt_len"][k]]) for k in (0, 1)
    ]
    assert prompts[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompts[1].endswith("2 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_a_failing_chat_template_names_the_sample(tmp_path):
    template = (
        "{%- if messages[0].role == 'system' -%}{{- raise_exception('no system turns') -}}"
        "{%- endif -%}" + QWEN3_TEMPLATE
    )
    tokenizer_dir = make_tokenizer(tmp_path / "tok", template)
    bad = sample("2 + 2?", "\nadd\n", "\n\n4", history=[{"role": "system", "content": "Be brief."}])
    rows = [sample("What is 2 + 2?", "\nadd\n", "\n\n4"), bad]
    with pytest.raises(TokenizeError, match=f"sample {bad['id']}: the chat template failed"):
        tokenize(samples_frame(rows), config_for(tokenizer_dir))


def test_tokenizer_without_think_tokens_fails_naming_them(tmp_path):
    tokenizer_dir = make_tokenizer(tmp_path / "tok", think_tokens=False)
    samples = samples_frame([sample("What is 2 + 2?", "\nadd\n", "\n\n4")])
    with pytest.raises(TokenizeError) as err:
        tokenize(samples, config_for(tokenizer_dir))
    message = str(err.value)
    assert "'<think>'" in message and "target.think_tokens" in message

    # Ids given in config do not make it the target's tokenizer: it has no think token at all.
    config = config_for(tokenizer_dir)
    config["target"]["think_tokens"].update(start_id=1, end_id=2)
    with pytest.raises(TokenizeError, match="has no single token '<think>', and id 1 decodes"):
        tokenize(samples, config)


def test_think_ids_that_differ_from_the_tokenizers_stop_tokenize(qwen3_dir):
    """The guard: the config's (probe.json's) think ids must be the tokenizer's own, as when
    transformers loads a fallback tokenizer for Kimi-K2.5 whose ids are not 163606/163607."""
    tokenizer = load(qwen3_dir)
    start, end = tokenizer.convert_tokens_to_ids([THINK_START, THINK_END])
    samples = samples_frame([sample("What is 2 + 2?", "\nadd\n", "\n\n4")])
    config = config_for(qwen3_dir)
    config["target"]["think_tokens"].update(start_id=start, end_id=end + 1)
    with pytest.raises(TokenizeError) as err:
        tokenize(samples, config)
    message = str(err.value)
    assert (
        f"think end token: probe.json says '</think>' is id {end + 1} (source: config)" in message
    )
    assert f"has '</think>' as id {end}" in message

    # The tokenizer's own ids, given in config (as the Kimi-K2.5 example does): tokenize runs.
    config["target"]["think_tokens"].update(end_id=end)
    frame, _, report = tokenize(samples, config)
    completion = frame["input_ids"][0].to_list()[frame["prompt_len"][0] :]
    assert completion[0] == start and end in completion
    assert report["target_tokens"]["think_source"] == "config"


def test_unknown_end_of_turn_token_is_named(qwen3_dir):
    samples = samples_frame([sample("What is 2 + 2?", "\nadd\n", "\n\n4")])
    with pytest.raises(TokenizeError, match=r"tokenize.end_of_turn_token '<\|eot\|>'"):
        tokenize(samples, config_for(qwen3_dir, end_of_turn_token="<|eot|>"))
    frame, _, report = tokenize(samples, config_for(qwen3_dir, end_of_turn_token="<|endoftext|>"))
    assert report["target_tokens"]["end_of_turn"]["source"] == "config"
    assert frame["input_ids"][0].to_list()[-1] == load(qwen3_dir).convert_tokens_to_ids(
        "<|endoftext|>"
    )


def test_loss_mask_covers_the_completion_through_end_of_turn(qwen3_dir):
    tokenizer = load(qwen3_dir)
    frame, counts, report = tokenize(
        samples_frame([sample("What is 2 + 2?", "\nadd\n", "\n\n4")]), config_for(qwen3_dir)
    )
    ids = frame["input_ids"][0].to_list()
    prompt_len = frame["prompt_len"][0]
    mask = loss_mask(prompt_len, len(ids))
    assert mask[:prompt_len].sum() == 0 and mask[prompt_len:].all()
    assert ids[prompt_len] == tokenizer.convert_tokens_to_ids(THINK_START)  # first completion id
    assert ids[-1] == tokenizer.convert_tokens_to_ids(END_OF_TURN) and mask[-1] == 1
    assert tokenizer.decode(ids[:prompt_len]).endswith("<|im_start|>assistant\n")
    # The counts are exactly the loss-masked ids.
    expected = np.bincount(ids[prompt_len:], minlength=counts.target_vocab_size)
    assert np.array_equal(counts.counts, expected)
    assert report["loss_tokens"] == len(ids) - prompt_len


def test_max_length_drop_and_truncate_are_counted(qwen3_dir):
    rows = [
        sample("What is 2 + 2?", "\nadd\n", "\n\n4"),
        sample("What is 2 + 3?", "\nadd the units\n" * 30, "\n\n5"),
        sample("Count the letters in banana, then sort them. " * 20, "\nx\n", "\n\n6"),
    ]
    samples = samples_frame(rows)
    full, _, _ = tokenize(samples, config_for(qwen3_dir, max_length=None))
    lengths, prompt_lens = full["n_tokens"].to_list(), full["prompt_len"].to_list()
    max_length = lengths[0] + 5
    assert lengths[1] > max_length and prompt_lens[2] >= max_length

    dropped, _, report = tokenize(samples, config_for(qwen3_dir, max_length=max_length))
    assert dropped["id"].to_list() == [rows[0]["id"]]
    assert report["overlength"]["dropped"] == 2 and report["overlength"]["truncated"] == 0

    cut, counts, report = tokenize(
        samples, config_for(qwen3_dir, max_length=max_length, overlength="truncate")
    )
    assert cut["id"].to_list() == [rows[0]["id"], rows[1]["id"]]
    assert cut["truncated"].to_list() == [False, True]
    assert cut["n_tokens"].to_list() == [lengths[0], max_length]
    assert cut["input_ids"][1].to_list() == full["input_ids"][1].to_list()[:max_length]
    assert report["overlength"] == {
        "max_length": max_length,
        "policy": "truncate",
        "dropped": 0,
        "dropped_prompt_over_max_length": 1,
        "truncated": 1,
        "longest": max(lengths[1:]),
    }
    assert (
        report["loss_tokens"]
        == int(counts.counts.sum())
        == sum(n - p for n, p in zip(cut["n_tokens"], cut["prompt_len"]))
    )


def test_a_max_length_that_keeps_no_sample_of_a_shard_names_the_key(qwen3_dir):
    """Every answer over tokenize.max_length (a study merged over the demo's 1,024 dropped all
    of its): the shard fails at tokenize, naming the key and the longest answer, not later on an
    empty shard."""
    rows = [sample("What is 2 + 3?", "\nadd the units\n" * 30, "\n\n5")] * 2
    samples = samples_frame([{**row, "id": f"{i:016x}"} for i, row in enumerate(rows)])
    full, _, _ = tokenize(samples, config_for(qwen3_dir, max_length=None))
    longest = max(full["n_tokens"].to_list())
    with pytest.raises(TokenizeError) as err:
        tokenize(samples, config_for(qwen3_dir, max_length=longest - 1), shard="00007")
    message = str(err.value)
    assert "shard 00007: kept none of its 2 samples: 2 longer than tokenize.max_length" in message
    assert f"the longest {longest} tokens" in message and "max_length to null" in message


def test_shard_files_and_an_empty_shard(tmp_path, qwen3_dir):
    samples = tmp_path / "samples.parquet"
    samples_frame([sample("What is 2 + 2?", "\nadd\n", "\n\n4")]).write_parquet(samples)
    out = {name: tmp_path / name for name in ("t.parquet", "c.safetensors", "r.json")}
    config = config_for(qwen3_dir)
    settings, probe = TokenizeSettings.from_config(config), tmp_path / "probe.json"
    write_probe(probe, config)
    report = tokenize_shard(samples, probe, *out.values(), settings, shard="00001")
    tokens = pl.read_parquet(out["t.parquet"])
    TokensSchema.validate(tokens)
    assert read_json(out["r.json"]) == json.loads(json.dumps(report))
    counts = read_token_counts(out["c.safetensors"])
    assert counts.counts.sum() == report["loss_tokens"] > 0
    think_end = load(qwen3_dir).convert_tokens_to_ids(THINK_END)
    assert counts.special_tokens[think_end] == THINK_END

    empty = tmp_path / "empty.parquet"
    samples_frame([]).write_parquet(empty)
    report = tokenize_shard(empty, probe, *out.values(), settings, shard="00002")
    assert report["written"] == 0 and pl.read_parquet(out["t.parquet"]).height == 0
    assert read_token_counts(out["c.safetensors"]).counts.sum() == 0


@pytest.mark.slow
def test_demo_server_ids_equal_the_rebuild_for_every_sample(tmp_path, demo_target_dir):
    """The real demo target behind the real server (vLLM dialect): the ids rebuilt from the text
    equal the server's ids, sample for sample, and the server's ids are what is written."""
    import torch
    from support.generation import shard_settings

    from eaglenest.common.io import write_json
    from eaglenest.demo.server_process import running_server
    from eaglenest.demo.tasks import heldout_examples
    from eaglenest.settings.samples import ValidationSettings
    from eaglenest.stages.generate.generate import generate_shard
    from eaglenest.stages.samples.validate import validate_frame

    torch.set_num_threads(1)
    examples = heldout_examples(seed=3, n=12)
    prompts = pl.DataFrame(
        [
            {
                "id": sample_id(e.prompt),
                "messages": [{"role": "user", "content": e.prompt}],
                "source": "demo",
                "source_index": i,
            }
            for i, e in enumerate(examples)
        ]
    )
    prompts.write_parquet(tmp_path / "prompts.parquet")
    probe = {"reasoning_field": "reasoning", "token_ids": {"supported": True}}
    write_json(tmp_path / "probe.json", probe)
    with running_server(demo_target_dir, model_name="demo", dialect="vllm", threads=1) as url:
        config = validate_config(
            {
                "target": {
                    "model": "demo",
                    "path": str(demo_target_dir),
                    "chat_template_kwargs": {"enable_thinking": True},
                },
                "endpoints": [{"url": url}],
                # Greedy: a sampled answer may spell a text in non-canonical tokens (e.g. "\n","\n"
                # for "\n\n", 1 of 400 demo answers at temperature 0.7), which no rebuild can
                # recover; the agreement share reports those, this test wants the exact case.
                "generation": {"temperature": 0.0, "max_tokens": 160},
            }
        )
        generate_shard(
            tmp_path / "prompts.parquet",
            tmp_path / "probe.json",
            tmp_path / "raw.parquet",
            *shard_settings(config),
            tmp_path / "journal.jsonl",
        )
    samples, _ = validate_frame(
        pl.read_parquet(tmp_path / "raw.parquet"),
        prompts,
        probe,
        settings_from_sections(ValidationSettings, validation={"max_truncated_fraction": 0.5}),
        "00000",
    )
    assert samples.height >= 8

    frame, _, report = tokenize(samples, config, "00000")
    assert report["agreement"]["compared"] == samples.height
    assert report["agreement"]["share"] == 1.0, report["agreement"]["first_mismatches"]
    assert frame["token_source"].unique().to_list() == ["server"]
    assert report["end_of_turn_appended"] == 0 and report["server_ids_text_mismatch"] == 0

    # Without the server's ids, the rebuild writes the very same sequences.
    no_ids = samples.with_columns(
        pl.lit(None, dtype=pl.List(pl.Int64)).alias("prompt_token_ids"),
        pl.lit(None, dtype=pl.List(pl.Int64)).alias("completion_token_ids"),
    )
    rebuilt, _, report = tokenize(no_ids, config, "00000")
    assert rebuilt["token_source"].unique().to_list() == ["rebuilt"]
    assert rebuilt["input_ids"].to_list() == frame["input_ids"].to_list()
    assert rebuilt["prompt_len"].to_list() == frame["prompt_len"].to_list()
    assert report["dropped_rebuild_decode_mismatch"] == 0


# Kimi-K2.5's tokenizer is remote code (tokenizer_config.json auto_map), and has imported
# bytes_to_unicode from where transformers 5.24 no longer has it.
KIMI_TOKENIZER_CODE = """\
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
from transformers import PreTrainedTokenizer


class TikTokenTokenizer(PreTrainedTokenizer):
    pass
"""


def name_tokenizer_class(tokenizer_dir: Path, name: str, auto_map: str | None = None) -> Path:
    path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(path.read_text()) | {"tokenizer_class": name}
    if auto_map:
        config["auto_map"] = {"AutoTokenizer": [auto_map, None]}
    path.write_text(json.dumps(config))
    return tokenizer_dir


def test_a_tokenizer_of_another_class_than_the_target_names_stops_tokenize(qwen3_dir, tmp_path):
    """tokenizer_config.json names a class transformers does not have (remote code, as Kimi's
    TikTokenTokenizer) and transformers falls back to its generic TokenizersBackend: not the
    target's tokenizer, even when the think ids happen to agree."""
    import shutil

    tokenizer_dir = name_tokenizer_class(
        Path(shutil.copytree(qwen3_dir, tmp_path / "tok")), "TikTokenTokenizer"
    )
    samples = samples_frame([sample("What is 2 + 2?", "\nadd\n", "\n\n4")])
    with pytest.raises(TokenizeError, match="names tokenizer_class TikTokenTokenizer, but "
                       "transformers loaded TokenizersBackend"):  # fmt: skip
        tokenize(samples, config_for(tokenizer_dir))
    # A class of transformers' own that it replaced by the generic one (DeepSeek-V3 names
    # LlamaTokenizerFast over a byte-level tokenizer.json) reads the same files: it runs.
    name_tokenizer_class(tokenizer_dir, "LlamaTokenizerFast")
    frame, _, _ = tokenize(samples, config_for(tokenizer_dir))
    assert frame.height == 1


def test_remote_tokenizer_code_that_fails_to_import_names_target_version_and_import(
    qwen3_dir, tmp_path, monkeypatch
):
    """As the Kimi-K2.5 example runs (trust_remote_code, think ids in config): the tokenizer's
    own code fails to import under this transformers, and the error says which target, which
    transformers and which line of the model's code."""
    import shutil

    import transformers
    import transformers.dynamic_module_utils

    # transformers copies remote code to its modules cache: one in the test's directory
    monkeypatch.setattr(
        transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules")
    )
    tokenizer_dir = Path(shutil.copytree(qwen3_dir, tmp_path / "kimi-tok"))
    (tokenizer_dir / "tokenization_kimi.py").write_text(KIMI_TOKENIZER_CODE)
    name_tokenizer_class(tokenizer_dir, "TikTokenTokenizer", "tokenization_kimi.TikTokenTokenizer")
    config = config_for(tokenizer_dir)
    config["target"].update(trust_remote_code=True)
    tokenizer = load(qwen3_dir)
    config["target"]["think_tokens"].update(
        zip(("start_id", "end_id"), tokenizer.convert_tokens_to_ids([THINK_START, THINK_END]))
    )
    samples = samples_frame([sample("What is 2 + 2?", "\nadd\n", "\n\n4")])
    with pytest.raises(RemoteCodeError) as err:
        tokenize(samples, config)
    message = str(err.value)
    assert f"the tokenizer of target '{tokenizer_dir}'" in message  # target.path
    assert f"transformers {transformers.__version__}" in message
    assert (
        "tokenization_kimi.py:1: from transformers.models.gpt2.tokenization_gpt2 import "
        "bytes_to_unicode -> cannot import name 'bytes_to_unicode'" in message
    )
