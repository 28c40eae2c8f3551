"""The evaluation in both thinking modes: the held-out prompts rendered with the chat template's
switch the other way are exactly the template's own rendering (the demo's Qwen3 template,
switched by enable_thinking, and its Kimi-K2.5 one, by thinking), a template without a switch and
`evaluate.thinking_modes: generated` say why there is no other mode, a run generated with
thinking off has on as its other mode, and metrics.json's `thinking` names the drafter's training
mode and the figures and cost of each mode."""

from pathlib import Path

import polars as pl
import pytest
from support.tiny_tokenizer import QWEN3_TEMPLATE, make_tokenizer

import eaglenest.demo
from eaglenest.common.config import validate_config
from eaglenest.settings.thinking import ThinkingSettings
from eaglenest.stages.evaluate.thinking import other_mode, thinking_section
from eaglenest.target_model.encoding import encode_batch

DEMO = Path(eaglenest.demo.__file__).parent
CHATS = [[{"role": "user", "content": "What is 2 + 2?"}], [{"role": "user", "content": "banana"}]]
NO_SWITCH = QWEN3_TEMPLATE.split("{%- if enable_thinking")[0] + "{%- endif -%}"


def settings(tokenizer_dir: Path, kwargs: dict, **evaluate) -> ThinkingSettings:
    config = {"target": {"path": str(tokenizer_dir), "chat_template_kwargs": kwargs}}
    return ThinkingSettings.from_config(validate_config({**config, "evaluate": evaluate}))


def rendered(tokenizer_dir: Path, **kwargs) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False, **kwargs)
        for c in CHATS
    ]
    return encode_batch(tokenizer, texts)


@pytest.mark.parametrize(
    ("template", "switch"),
    [("chat_template.jinja", "enable_thinking"), ("kimi_chat_template.jinja", "thinking")],
)
def test_the_other_mode_is_the_templates_own_rendering(tmp_path, template, switch):
    tokenizer_dir = make_tokenizer(tmp_path, chat_template=(DEMO / template).read_text())
    on = rendered(tokenizer_dir, **{switch: True})
    found = other_mode(on, settings(tokenizer_dir, {switch: True}))
    assert (found.switch, found.generated, found.other) == (switch, "on", "off")
    assert found.prompts == rendered(tokenizer_dir, **{switch: False}) != on
    assert found.groups() == {"thinking:off": found.prompts} and found.not_flipped == 0
    # From thinking off, the other mode is on, with the switch found though the config sets none.
    back = other_mode(found.prompts, settings(tokenizer_dir, {}))
    assert (back.generated, back.other, back.prompts) == ("off", "on", on)


def test_a_run_generated_with_thinking_off_evaluates_on_as_the_other_mode(tmp_path):
    """The generated mode is read per prompt: most held-out prompts end in the off tail, so off
    is the run's own mode; a prompt in the other mode is left out and counted."""
    tokenizer_dir = make_tokenizer(
        tmp_path, chat_template=(DEMO / "chat_template.jinja").read_text()
    )
    off, on = rendered(tokenizer_dir, enable_thinking=False), rendered(tokenizer_dir)
    found = other_mode([on[0], *off], settings(tokenizer_dir, {"enable_thinking": False}))
    assert (found.generated, found.other, found.not_flipped) == ("off", "on", 1)
    assert found.prompts == on and found.groups() == {"thinking:on": on}


def test_no_other_mode_without_a_switch_or_when_not_asked(tmp_path):
    tokenizer_dir = make_tokenizer(tmp_path, chat_template=NO_SWITCH)
    found = other_mode(rendered(tokenizer_dir), settings(tokenizer_dir, {}))
    assert found.groups() == {} and "has no such thinking switch" in found.skipped
    asked = other_mode([[1, 2]], settings(tokenizer_dir, {}, thinking_modes="generated"))
    assert asked.skipped == "evaluate.thinking_modes is generated"


def test_metrics_name_the_training_mode_and_what_the_other_mode_costs(tmp_path):
    tokenizer_dir = make_tokenizer(
        tmp_path / "tok", chat_template=(DEMO / "chat_template.jinja").read_text()
    )
    found = other_mode(rendered(tokenizer_dir), settings(tokenizer_dir, {"enable_thinking": True}))
    pl.DataFrame({"thinking": [True, True]}).write_parquet(tmp_path / "train.parquet")
    figures = lambda length: {"3": {"acceptance_length": length, "emitted_per_round": length}}
    metrics = {
        "live": figures(2.0),
        "live_groups": {"thinking:off": figures(1.5)},
        "engine": {"per_k": figures(2.2), "by_depth": {"0": {}, "thinking:off": figures(1.1)}},
    }
    section = thinking_section(found, metrics, [tmp_path / "train.parquet"]).to_json()
    assert section["trained"] == {"mode": "on", "samples": {"on": 2}}
    assert (section["heldout_mode"], section["other_mode"]) == ("on", "off")
    assert section["modes"]["off"]["engine"]["3"]["acceptance_length"] == 1.1
    assert section["other_vs_generated"] == {"live": {"3": 0.75}, "engine": {"3": 0.5}}
    # The other mode's figures are taken out of the engine's depths and the live groups.
    assert metrics["engine"]["by_depth"] == {"0": {}} and "live_groups" not in metrics
