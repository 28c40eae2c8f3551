"""The standard sets as the evaluate stage decodes them (stages/evaluate/sets.py, and the plain
engine's turn-by-turn rendering, vllm_engine/conversations.py): first turns rendered by the
target's chat template with target.chat_template_kwargs, later turns after the target's own
answers (their reasoning dropped as the template drops it), the engine sized for the longest
turn, the recorded prompts grouped by category for the K engines, and the figures per set and
per category, each naming its set, category and temperature. The engines themselves decode
the sets in tests/engine/test_vllm_acceptance.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.eval_sets import prepare_demo_sets, set_decoding

from eaglenest.stages.evaluate.sets import engine_sets, group_name
from eaglenest.stages.evaluate.vllm_evaluate import acceptance
from eaglenest.target_model.tokenizer import open_tokenizer
from eaglenest.vllm_engine.conversations import answer_message, later_turn_prompt

MAX_NEW_TOKENS = 40


def prepared_set(tmp_path: Path) -> Path:
    """The demo's questions as MT-Bench JSONL, prepared as prepare_eval_set writes them."""
    return prepare_demo_sets(tmp_path)[0]


def decode_settings(target: Path, kwargs: dict, names: tuple[str, ...] = ("mt_bench",)):
    return set_decoding(target, kwargs, names)


@pytest.fixture(scope="module")
def tokenizer(demo_target_dir: Path):
    return open_tokenizer(demo_target_dir, trust_remote_code=False)


def test_first_turns_are_rendered_as_generation_renders_them(
    tmp_path: Path, demo_target_dir: Path, tokenizer
):
    path = prepared_set(tmp_path)
    thinking = engine_sets([path], decode_settings(demo_target_dir, {}), MAX_NEW_TOKENS)
    off = {"enable_thinking": False}
    not_thinking = engine_sets([path], decode_settings(demo_target_dir, off), MAX_NEW_TOKENS)
    (mt_bench,) = thinking.sets
    row = mt_bench.rows[0]
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": row["turns"][0]}], add_generation_prompt=True, tokenize=False
    )
    assert row["first_prompt"] == tokenizer(expected, add_special_tokens=False)["input_ids"]
    # The template's switch reaches the prompt: thinking off pre-fills an empty think block.
    off_prompt = not_thinking.sets[0].rows[0]["first_prompt"]
    assert tokenizer.decode(off_prompt).endswith("<think>\n\n</think>\n\n")
    assert not tokenizer.decode(row["first_prompt"]).endswith("</think>\n\n")
    assert thinking.chat_template_kwargs == {} and not_thinking.chat_template_kwargs == off
    # Every second or later turn has room for the answers before it.
    two_turns = [r for r in mt_bench.rows if len(r["turns"]) == 2]
    assert (
        two_turns and mt_bench.longest_prompt > len(two_turns[0]["first_prompt"]) + MAX_NEW_TOKENS
    )
    request = {"max_new_tokens": MAX_NEW_TOKENS, "max_model_len": 10}
    sized = thinking.sized(request, None)
    assert sized["max_model_len"] == mt_bench.longest_prompt + MAX_NEW_TOKENS
    assert thinking.sized(request, 4096)["max_model_len"] == 4096  # the user's vllm.max_model_len
    plain = thinking.plain_request(sized)
    assert plain["k"] is None
    assert plain["sets"]["mt_bench"]["max_prompt_len"] == mt_bench.longest_prompt
    assert "sets" not in sized  # the K engines decode the recorded prompts, never turn by turn
    assert engine_sets([], None, MAX_NEW_TOKENS) is None  # a run without sets


def test_a_later_turn_follows_the_targets_own_answer(tokenizer):
    """The plain engine's rendering of turn 2: the first answer given back as a client sends it
    (reasoning apart from content); the demo's template drops earlier turns' reasoning."""
    answer_text = "<think>\nadd them\n</think>\n\nThe sum is 7."
    answer_ids = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
    answer_ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    message = answer_message(tokenizer, answer_ids)
    assert message == {
        "role": "assistant",
        "content": "The sum is 7.",
        "reasoning_content": "add them",
    }
    row = {"system": None, "turns": ["What is 3 + 4?", "Check your answer once more."]}
    ids = later_turn_prompt(tokenizer, row, [answer_ids], {})
    text = tokenizer.decode(ids)
    expected = (
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\nThe sum is 7."
        "<|im_end|>\n<|im_start|>user\nCheck your answer once more.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected
    assert answer_message(tokenizer, tokenizer("Just this.")["input_ids"]) == {
        "role": "assistant",
        "content": "Just this.",
    }


def spec(drafts: int, accepted: int, k: int) -> dict:
    per_position = [accepted // k] * k
    per_position[0] += accepted - sum(per_position)
    return {
        "drafts": drafts,
        "draft_tokens": drafts * k,
        "accepted_tokens": accepted,
        "accepted_per_position": per_position,
    }


def test_figures_per_set_and_category_name_their_set_and_temperature(
    tmp_path: Path, demo_target_dir: Path
):
    sets = engine_sets([prepared_set(tmp_path)], decode_settings(demo_target_dir, {}), 40)
    (mt_bench,) = sets.sets
    # A plain decoding as the engine answers it: each row's turns, prompt and answer ids.
    prompts, answers = [], []
    for index, row in enumerate(mt_bench.rows):
        turns = range(len(row["turns"]))
        prompts.append([[index, turn] for turn in turns])
        answers.append([[100 + index, 200 + turn, 7] for turn in turns])
    plain = {"sets": {"mt_bench": {"prompts": prompts, "answers": answers, "wall_s": 2.0}}}
    groups = sets.groups(plain)
    categories = sorted({row["category"] for row in mt_bench.rows})
    assert sorted(groups) == [group_name("mt_bench", c) for c in categories]
    turns = sum(len(row["turns"]) for row in mt_bench.rows)
    assert sum(len(g) for g in groups.values()) == turns
    # Each K's engine answers each group with the plain tokens; 2 rounds a prompt.
    k = 3
    answer = {"groups": {}}
    for index, (key, group) in enumerate(groups.items()):
        plain_tokens = [
            a
            for row, row_answers in zip(mt_bench.rows, answers, strict=True)
            if group_name("mt_bench", row["category"]) == key
            for a in row_answers
        ]
        answer["groups"][key] = {
            "tokens": plain_tokens,
            "wall_s": 0.5,
            "spec": spec(2 * len(group), (index + 1) * len(group), k),
            "rounds_per_prompt": [2] * len(group),
        }
    figures = sets.figures({k: answer}, plain, acceptance)["mt_bench"]
    assert figures["set"] == "mt_bench" and figures["temperature"] == 0.0
    assert figures["prompts"] == len(mt_bench.rows) and figures["turns"] == turns
    assert "live loop" in figures["live"]
    whole = figures["engine"]["per_k"]["3"]
    assert (whole["set"], whole["category"], whole["temperature"]) == ("mt_bench", None, 0.0)
    accepted = sum(g["spec"]["accepted_tokens"] for g in answer["groups"].values())
    assert whole["acceptance_length"] == pytest.approx(1 + accepted / (2 * turns))
    assert whole["prompts"] == turns and whole["identical_to_plain"]
    assert whole["emitted_per_round"] == pytest.approx((3 * turns - turns) / (2 * turns))
    assert "speedup" not in whole
    assert set(figures["engine"]["by_category"]) == set(categories)
    for index, category in enumerate(groups):  # the order the answers were made in
        name = category.split("/")[-1]
        per_k = figures["engine"]["by_category"][name]["3"]
        assert per_k["category"] == name and per_k["set"] == "mt_bench"
        assert per_k["acceptance_length"] == pytest.approx(1 + (index + 1) / 2)
    assert "sampled" not in figures  # greedy engines only
    # The engines also sampled (evaluate's sampled temperature): a table per temperature, each
    # figure naming it, its own reference (a sampled answer equals no plain one).
    for index, group in enumerate(answer["groups"].values()):
        drafts = 3 * len(groups[list(answer["groups"])[index]])
        group["sampled"] = {"0.7": {**group, "spec": spec(drafts, index, k)}}
    sampled = sets.figures({k: answer}, plain, acceptance)["mt_bench"]["sampled"]["0.7"]
    whole = sampled["per_k"]["3"]
    assert (whole["temperature"], whole["set"], whole["identical_to_plain"]) == (
        0.7,
        "mt_bench",
        None,
    )
    accepted = sum(range(len(groups)))
    assert whole["acceptance_length"] == pytest.approx(1 + accepted / (3 * turns))
    assert set(sampled["by_category"]) == set(categories)
    assert all(f["3"]["temperature"] == 0.7 for f in sampled["by_category"].values())
    # A plain decoding without the set (one made before the sets were added) is refused.
    with pytest.raises(ValueError, match="set mt_bench: the plain decoding holds no such set"):
        sets.groups({"sets": {}})


def test_sets_of_another_run_are_refused(tmp_path: Path, demo_target_dir: Path):
    settings = decode_settings(demo_target_dir, {}, ("gsm8k",))
    with pytest.raises(ValueError, match=r"evaluate.sets \['gsm8k'\]: no prepared file"):
        engine_sets([prepared_set(tmp_path)], settings, MAX_NEW_TOKENS)
