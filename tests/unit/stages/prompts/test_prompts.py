"""Tests of the prompts stage: source schemas, trimming, ids, dedup, seeded order, sharding,
skip counts, errors, and the PromptsSchema contract. Every source is a small file made here."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandera.errors
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglenest.common.config import ConfigError, validate_config
from eaglenest.formats.prompts import PromptsSchema, empty_prompts_frame
from eaglenest.run.shards import (
    prepared_params_json,
    shard_bounds,
    shard_ids,
    shard_params_json,
)
from eaglenest.settings.prompts import source_kind
from eaglenest.stages.prompts.listing import walk_order
from eaglenest.stages.prompts.normalise import SKIP_REASONS, prompt_id
from eaglenest.stages.prompts.prompts import (
    prepare_prompts,
    validate_prompts,
    write_prompt_shard,
)
from eaglenest.stages.prompts.sources import PromptSourceError, local_source_files


def write_jsonl(path: Path, rows: list) -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def config_for(source, **prompts) -> dict:
    """A validated config (defaults filled in) of this source and these `prompts` keys."""
    return validate_config(
        {"seed": prompts.pop("seed", 0), "prompts": {"source": source, **prompts}}
    )


def all_prompts(tmp_path: Path, config: dict) -> tuple[pl.DataFrame, dict]:
    """The full ordered list and the report of `config`'s source."""
    out = tmp_path / "prepared" / "all.parquet"
    report = prepare_prompts(config, out, tmp_path / "prepared" / "report.json")
    return pl.read_parquet(out), report


def messages_of(frame: pl.DataFrame) -> list[list[dict]]:
    return frame["messages"].to_list()


SHAREGPT_ROW = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "What is 2 + 2?"},
        {"from": "gpt", "value": "4"},
    ],
    "source": "math",
}
EXPECTED = [{"role": "system", "content": "Be brief."}, user("What is 2 + 2?")]


# --- config and shard arithmetic --------------------------------------------------------------


def test_demo_defaults_give_four_shards_of_100():
    assert shard_ids(validate_config({})) == ["00000", "00001", "00002", "00003"]
    assert shard_bounds(validate_config({}), "00003") == (300, 400)


def test_last_shard_is_short_and_unknown_shards_are_refused():
    config = config_for("demo", max_samples=450, shard_size=100)
    assert shard_ids(config)[-1] == "00004"
    assert shard_bounds(config, "00004") == (400, 450)
    with pytest.raises(ValueError, match="shards 00000..00004"):
        shard_bounds(config, "00005")
    with pytest.raises(ValueError, match="unknown prompt shard '4'"):
        shard_bounds(config, "4")


def test_reading_the_config_does_not_change_it():
    config = config_for("demo", columns={"prompt": "question"})
    shard_ids(config)
    assert config == config_for("demo", columns={"prompt": "question"})


def test_unknown_prompts_key_names_the_key():
    with pytest.raises(ConfigError, match="prompts.shard_szie.*did you mean 'shard_size'"):
        shard_ids(config_for("demo", shard_szie=10))


def test_prepared_params_ignore_the_sample_count_but_not_the_list_settings():
    base = prepared_params_json(config_for("demo", max_samples=400))
    assert prepared_params_json(config_for("demo", max_samples=800, shard_size=50)) == base
    assert prepared_params_json(config_for("demo", seed=1)) != base
    assert prepared_params_json(config_for("demo", max_prompt_chars=100)) != base
    # Only the slice a shard holds decides whether it reruns.
    assert shard_params_json(config_for("demo", max_samples=450), "00001") == shard_params_json(
        config_for("demo", max_samples=900), "00001"
    )
    assert shard_params_json(config_for("demo", max_samples=450), "00004") != shard_params_json(
        config_for("demo", max_samples=900), "00004"
    )


def test_source_kinds_and_local_files(tmp_path):
    for name in ("b.jsonl", "a.jsonl"):
        write_jsonl(tmp_path / name, [{"prompt": name}])
    assert source_kind("demo") == "demo"
    assert source_kind("mlabonne/open-perfectblend") == "dataset"
    assert source_kind(str(tmp_path)) == "dataset"  # a directory goes through load_dataset
    assert source_kind(str(tmp_path / "a.jsonl")) == "files"
    assert source_kind([str(tmp_path / "a.jsonl")]) == "files"
    assert local_source_files(config_for(str(tmp_path / "*.jsonl"))) == [
        str(tmp_path / "a.jsonl"),
        str(tmp_path / "b.jsonl"),
    ]
    assert local_source_files(config_for("demo")) == []
    with pytest.raises(PromptSourceError, match="file not found"):
        local_source_files(config_for(str(tmp_path / "missing.jsonl")))


# --- the schemas a source may have --------------------------------------------------------------


def test_sharegpt_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [SHAREGPT_ROW])
    frame, report = all_prompts(tmp_path, config_for(str(path), max_samples=1))
    assert messages_of(frame) == [EXPECTED]
    assert frame["source"].to_list() == [str(path)]
    assert frame["source_index"].to_list() == [0]
    assert report["prompts_by_format"] == {"sharegpt": 1}


def test_messages_json_list_with_content_parts(tmp_path):
    rows = [
        {"messages": [{"role": "developer", "content": "Be brief."}, user("What is 2 + 2?")]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, "there"]}]},
    ]
    path = tmp_path / "chats.json"
    path.write_text(json.dumps({"data": rows}))
    frame, report = all_prompts(tmp_path, config_for(str(path), max_samples=2, shuffle=False))
    assert messages_of(frame) == [EXPECTED, [user("Hi\nthere")]]
    assert report["prompts_by_format"] == {"messages": 2}


def test_prompt_and_instruction_columns_in_parquet(tmp_path):
    table = pa.table(
        {
            "prompt": ["What is 2 + 2?", None, None],
            "instruction": [None, "Translate to French.", "Say hi."],
            "input": [None, "cat", ""],
            "system": ["Be brief.", None, None],
            "output": ["4", "chat", "hi"],
        }
    )
    path = tmp_path / "alpaca.parquet"
    pq.write_table(table, path)
    frame, report = all_prompts(tmp_path, config_for(str(path), max_samples=3, shuffle=False))
    assert messages_of(frame) == [
        EXPECTED,
        [user("Translate to French.\n\ncat")],
        [user("Say hi.")],
    ]
    assert frame["source_index"].to_list() == [0, 1, 2]
    assert report["prompts_by_format"] == {"prompt": 3}


def test_column_overrides_and_forced_format(tmp_path):
    path = write_jsonl(
        tmp_path / "qa.jsonl",
        [{"question": "Why?", "conversations": [{"from": "human", "value": "ignored"}]}],
    )
    config = config_for(str(path), max_samples=1, format="prompt", columns={"prompt": "question"})
    frame, _ = all_prompts(tmp_path, config)
    assert messages_of(frame) == [[user("Why?")]]


def test_hub_code_path_on_a_local_dataset_directory(tmp_path):
    dataset_dir = tmp_path / "perfectblend"
    dataset_dir.mkdir()
    write_jsonl(
        dataset_dir / "train.jsonl",
        [SHAREGPT_ROW, {"conversations": [SHAREGPT_ROW["conversations"][1]]}],
    )
    config = config_for(
        str(dataset_dir),
        split="train",
        max_samples=2,
        shuffle=False,
        cache_dir=str(tmp_path / "hf"),
    )
    frame, report = all_prompts(tmp_path, config)
    assert messages_of(frame) == [EXPECTED, [user("What is 2 + 2?")]]
    assert frame["source"].to_list() == [f"{dataset_dir}:train"] * 2
    assert report["source"] == f"{dataset_dir}:train"


def test_hub_code_path_with_a_builder_and_data_files(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": [user("Hello")]}])
    config = config_for("json", data_files=str(path), max_samples=1, cache_dir=str(tmp_path / "hf"))
    frame, _ = all_prompts(tmp_path, config)
    assert messages_of(frame) == [[user("Hello")]]


def test_a_missing_hub_split_names_source_and_split(tmp_path):
    dataset_dir = tmp_path / "ds"
    dataset_dir.mkdir()
    write_jsonl(dataset_dir / "train.jsonl", [{"prompt": "x"}])
    config = config_for(str(dataset_dir), split="test", cache_dir=str(tmp_path / "hf"))
    with pytest.raises(PromptSourceError, match=r"cannot load dataset .*ds.* split 'test'"):
        prepare_prompts(config, tmp_path / "all.parquet")


def test_a_table_without_known_columns_names_its_columns(tmp_path):
    path = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"question": ["Why?"], "answer": ["Because."]}), path)
    with pytest.raises(PromptSourceError, match="it has question, answer; set prompts.format"):
        prepare_prompts(config_for(str(path)), tmp_path / "all.parquet")


# --- what is kept of a conversation ------------------------------------------------------------


def test_turns_are_kept_up_to_the_last_user_turn(tmp_path):
    conversation = [
        {"role": "system", "content": "Be brief."},
        user("Hi"),
        {"role": "assistant", "content": "Hello!"},
        user("What is 2 + 2?"),
        {"role": "assistant", "content": "4"},
        {"role": "tool", "content": "after the last user turn: dropped with the answer"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}])
    frame, _ = all_prompts(tmp_path, config_for(str(path), max_samples=1))
    assert messages_of(frame) == [conversation[:4]]

    frame, _ = all_prompts(tmp_path, config_for(str(path), max_samples=1, keep_system=False))
    assert messages_of(frame) == [conversation[1:4]]


def test_whitespace_is_kept_and_an_empty_system_prompt_is_dropped(tmp_path):
    row = {"messages": [{"role": "system", "content": ""}, user("  two spaces\n")]}
    path = write_jsonl(tmp_path / "chat.jsonl", [row])
    frame, _ = all_prompts(tmp_path, config_for(str(path), max_samples=1))
    assert messages_of(frame) == [[user("  two spaces\n")]]


# --- ids and duplicates ------------------------------------------------------------------------


def test_ids_are_content_hashes_insensitive_to_key_order_and_extra_fields(tmp_path):
    canonical = json.dumps(
        [{"content": "Be brief.", "role": "system"}, {"content": "What is 2 + 2?", "role": "user"}],
        separators=(",", ":"),
    )
    expected = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert prompt_id(EXPECTED) == expected == "095fa2072cd9437c"  # pinned: ids never drift
    reordered = [{"content": m["content"], "role": m["role"]} for m in EXPECTED]
    assert prompt_id(reordered) == expected

    rows = [
        SHAREGPT_ROW,
        {"messages": [{"content": "Be brief.", "role": "system"}, user("What is 2 + 2?")]},
        {"prompt": "What is 2 + 2?", "system": "Be brief.", "id": "theirs"},
    ]
    for i, row in enumerate(rows):
        path = write_jsonl(tmp_path / f"one_{i}.jsonl", [row])
        frame, _ = all_prompts(tmp_path, config_for(str(path), max_samples=1))
        assert frame["id"].to_list() == [expected]


def test_duplicates_are_dropped_first_in_list_order_wins(tmp_path):
    rows = [{"prompt": "a"}, {"prompt": "b"}, {"messages": [user("a")]}, {"prompt": "a"}]
    path = write_jsonl(tmp_path / "dups.jsonl", rows)
    frame, report = all_prompts(tmp_path, config_for(str(path), max_samples=2, shuffle=False))
    assert messages_of(frame) == [[user("a")], [user("b")]]
    assert frame["source_index"].to_list() == [0, 1]
    assert report["skipped"]["duplicate"] == 2
    assert frame["id"].n_unique() == frame.height


# --- order, shuffle and shards ----------------------------------------------------------------


def numbered_source(tmp_path: Path, n: int) -> Path:
    return write_jsonl(tmp_path / "numbers.jsonl", [{"prompt": f"prompt {i}"} for i in range(n)])


def test_walk_order_is_seeded_and_a_pure_function_of_seed_and_position():
    first = walk_order(1000, seed=3, shuffle=True)
    assert sorted(first.tolist()) == list(range(1000))
    assert first.tolist() == walk_order(1000, seed=3, shuffle=True).tolist()
    assert first.tolist() != walk_order(1000, seed=4, shuffle=True).tolist()
    assert walk_order(5, seed=3, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    # Rows appended to a source keep the relative order of the existing rows.
    longer = walk_order(1500, seed=3, shuffle=True)
    assert [p for p in longer.tolist() if p < 1000] == first.tolist()
    assert walk_order(3, seed=-1, shuffle=True).shape == (3,)  # any integer seed works


def test_shuffle_is_seeded(tmp_path):
    path = numbered_source(tmp_path, 50)
    first, _ = all_prompts(tmp_path, config_for(str(path), max_samples=50, seed=7))
    again, _ = all_prompts(tmp_path, config_for(str(path), max_samples=50, seed=7))
    other, _ = all_prompts(tmp_path, config_for(str(path), max_samples=50, seed=8))
    plain, _ = all_prompts(tmp_path, config_for(str(path), max_samples=50, shuffle=False))
    assert first.equals(again)
    assert first["id"].to_list() != other["id"].to_list()
    assert sorted(first["id"].to_list()) == sorted(other["id"].to_list())
    assert plain["source_index"].to_list() == list(range(50))


def shard_frames(
    tmp_path: Path, config: dict, prepared: Path | None = None
) -> dict[str, pl.DataFrame]:
    tag = "prepared" if prepared else "direct"
    frames = {}
    for shard in shard_ids(config):
        out = (
            tmp_path
            / tag
            / f"{config['prompts'].get('max_samples', 'default')}"
            / f"{shard}.parquet"
        )
        write_prompt_shard(config, shard, out, prepared=prepared)
        frames[shard] = pl.read_parquet(out)
    return frames


def test_raising_max_samples_only_adds_shards(tmp_path):
    path = numbered_source(tmp_path, 100)
    small = config_for(str(path), max_samples=25, shard_size=10)
    large = config_for(str(path), max_samples=60, shard_size=10)
    small_shards = shard_frames(tmp_path, small)
    large_shards = shard_frames(tmp_path, large)
    assert list(small_shards) == ["00000", "00001", "00002"]
    assert len(large_shards) == 6
    for shard in ("00000", "00001"):
        assert small_shards[shard].equals(large_shards[shard])
    # The short last shard of the small run is the start of the same shard of the large one.
    assert small_shards["00002"].height == 5
    assert small_shards["00002"].equals(large_shards["00002"].head(5))


def test_prepared_and_direct_shards_are_identical(tmp_path):
    path = numbered_source(tmp_path, 40)
    config = config_for(str(path), max_samples=35, shard_size=10)
    prepared = tmp_path / "all.parquet"
    prepare_prompts(config, prepared)
    direct = shard_frames(tmp_path, config)
    sliced = shard_frames(tmp_path, config, prepared=prepared)
    assert direct.keys() == sliced.keys()
    for shard in direct:
        assert direct[shard].equals(sliced[shard])
    whole = pl.concat(direct.values())
    assert whole["id"].n_unique() == 35
    # A larger max_samples slices the same prepared list (it does not depend on max_samples).
    larger = config_for(str(path), max_samples=40, shard_size=10)
    write_prompt_shard(larger, "00003", tmp_path / "last.parquet", prepared=prepared)
    assert pl.read_parquet(tmp_path / "last.parquet").head(5).equals(sliced["00003"])


def test_a_stale_prepared_list_is_refused(tmp_path):
    path = numbered_source(tmp_path, 30)
    prepared = tmp_path / "all.parquet"
    prepare_prompts(config_for(str(path), max_samples=20, seed=1), prepared)
    changed = config_for(str(path), max_samples=20, seed=2, max_prompt_chars=100)
    with pytest.raises(PromptSourceError, match="prepared with other prompts settings .*seed"):
        write_prompt_shard(changed, "00000", tmp_path / "s.parquet", prepared=prepared)
    plain = tmp_path / "plain.parquet"
    good_frame().write_parquet(plain)
    with pytest.raises(PromptSourceError, match="not a prepared prompt list"):
        write_prompt_shard(changed, "00000", tmp_path / "s.parquet", prepared=plain)


def test_shard_report(tmp_path):
    path = numbered_source(tmp_path, 30)
    config = config_for(str(path), max_samples=25, shard_size=10)
    summary = write_prompt_shard(config, "00002", tmp_path / "s.parquet")
    assert summary == {
        "shard": "00002",
        "start": 20,
        "stop": 25,
        "prompts": 5,
        "short": False,
        "listed": 25,
        "sources": {str(path): 5},
    }


# --- rows that cannot be used, sources that give too few ---------------------------------------


def test_malformed_rows_are_skipped_and_counted_by_reason(tmp_path):
    rows = [
        {"prompt": "good one"},
        "{not json",
        "[1, 2]",
        {"text": "no known column"},
        {"messages": "not a list"},
        {"messages": [user("hi"), "not a turn", user("again")]},
        {"conversations": [{"from": "tool", "value": "x"}, {"from": "human", "value": "hi"}]},
        {"messages": [{"role": "assistant", "content": "only me"}]},
        {"messages": [user("hi"), {"role": "system", "content": "late"}, user("more")]},
        {"messages": [user("   ")]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        {"prompt": "x" * 50},
        {"prompt": "good one"},
        {"prompt": "good two"},
        "",
    ]
    path = write_jsonl(tmp_path / "messy.jsonl", rows)
    config = config_for(str(path), max_samples=2, max_prompt_chars=20, shuffle=False)
    frame, report = all_prompts(tmp_path, config)
    assert messages_of(frame) == [[user("good one")], [user("good two")]]
    assert frame["source_index"].to_list() == [0, 13]  # line numbers in the file
    assert report["rows_read"] == 14  # the blank last line is not a row
    assert report["skipped"] == {
        "invalid_json": 1,
        "unknown_schema": 2,
        "malformed_turn": 2,
        "unknown_role": 1,
        "non_text_content": 1,
        "no_user_turn": 1,
        "misplaced_system": 1,
        "empty_text": 1,
        "too_long": 1,
        "duplicate": 1,
    }
    assert set(report["skipped"]) == set(SKIP_REASONS)
    (invalid_json,) = report["skipped_examples"]["invalid_json"]
    assert invalid_json.startswith(f"{path} row 1: line 2: Expecting property name")
    assert json.loads((tmp_path / "prepared" / "report.json").read_text()) == report


def test_a_source_without_usable_rows_names_source_and_reasons(tmp_path):
    path = write_jsonl(
        tmp_path / "useless.jsonl",
        [{"text": "a"}, {"messages": [{"role": "assistant", "content": "b"}]}, {"text": "c"}],
    )
    out = tmp_path / "all.parquet"
    with pytest.raises(PromptSourceError) as error:
        prepare_prompts(config_for(str(path)), out)
    message = str(error.value)
    assert str(path) in message
    assert "no usable prompt" in message and "3 rows read" in message
    assert "no_user_turn 1" in message and "unknown_schema 2" in message
    assert "the row has: text" in message and "prompts.columns" in message
    assert not out.exists()  # atomic: no partial file
    assert list(tmp_path.glob(".all.parquet.*")) == []
    with pytest.raises(PromptSourceError, match="no usable prompt"):
        write_prompt_shard(config_for(str(path)), "00000", tmp_path / "s.parquet")


def test_too_few_prompts_fail_unless_short_shards_are_allowed(tmp_path):
    path = numbered_source(tmp_path, 15)
    config = config_for(str(path), max_samples=40, shard_size=10)
    with pytest.raises(
        PromptSourceError, match="has 15 usable prompts but prompts.max_samples is 40"
    ):
        prepare_prompts(config, tmp_path / "all.parquet")
    with pytest.raises(PromptSourceError, match="prompt shard 00000: .*allow_short"):
        write_prompt_shard(config, "00000", tmp_path / "s.parquet")

    config["prompts"]["allow_short"] = True
    prepared = tmp_path / "all.parquet"
    prepare_prompts(config, prepared)
    for frames in (shard_frames(tmp_path, config), shard_frames(tmp_path, config, prepared)):
        assert [f.height for f in frames.values()] == [10, 5, 0, 0]
        assert frames["00003"].schema == empty_prompts_frame().schema
    summary = write_prompt_shard(config, "00001", tmp_path / "s.parquet", prepared=prepared)
    assert summary["short"] and summary["prompts"] == 5 and summary["listed"] == 15


def test_unreadable_files_name_the_file(tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    with pytest.raises(PromptSourceError, match="broken.parquet: cannot read parquet"):
        prepare_prompts(config_for(str(broken)), tmp_path / "all.parquet")
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"a": 1}))
    with pytest.raises(PromptSourceError, match="odd.json: expected a list of rows"):
        prepare_prompts(config_for(str(odd)), tmp_path / "all.parquet")


# --- the file contract -------------------------------------------------------------------------


def good_frame() -> pl.DataFrame:
    return pl.DataFrame(
        {
            "id": [prompt_id(EXPECTED)],
            "messages": [EXPECTED],
            "source": ["test"],
            "source_index": [0],
        },
        schema=empty_prompts_frame().schema,
    )


def with_messages(frame: pl.DataFrame, messages: list[dict]) -> pl.DataFrame:
    return frame.with_columns(pl.Series("messages", [messages], dtype=frame.schema["messages"]))


@pytest.mark.parametrize(
    ("spoil", "complaint"),
    [
        (lambda f: f.with_columns(pl.col("id").str.slice(0, 8)), "str_matches"),
        (lambda f: f.with_columns(pl.col("source_index") - 1), "greater_than_or_equal_to"),
        (lambda f: f.with_columns(extra=pl.lit(1)), "extra"),
        (lambda f: f.with_columns(pl.col("source_index").cast(pl.Int32)), "Int32"),
        (lambda f: f.select(["messages", "id", "source", "source_index"]), "order"),
        (
            lambda f: with_messages(f, [user("q"), {"role": "assistant", "content": "a"}]),
            "end with a user turn",
        ),
        (lambda f: with_messages(f, []), "end with a user turn"),
        (
            lambda f: with_messages(f, [{"role": "tool", "content": "q"}, user("q")]),
            "every role must be one of",
        ),
        (
            lambda f: with_messages(f, [user("q"), {"role": "system", "content": "s"}, user("q")]),
            "system turn may only be the first",
        ),
        (lambda f: with_messages(f, [{"role": "user", "content": None}]), "non-null string"),
    ],
)
def test_the_schema_rejects_bad_frames(spoil, complaint):
    good = good_frame()
    assert PromptsSchema.validate(good).equals(good)
    with pytest.raises(pandera.errors.SchemaErrors, match=complaint):
        PromptsSchema.validate(spoil(good), lazy=True)


def test_duplicate_ids_in_a_file_are_rejected_with_the_file_name(tmp_path):
    path = tmp_path / "dup.parquet"
    pl.concat([good_frame(), good_frame()]).write_parquet(path)
    with pytest.raises(ValueError, match="dup.parquet: prompts do not match PromptsSchema"):
        validate_prompts(pl.read_parquet(path), path)


# --- the demo source -----------------------------------------------------------------------------


def test_demo_prompts_are_held_out_from_training(tmp_path):
    demo_tasks = pytest.importorskip("eaglenest.demo.tasks")
    config = config_for("demo")
    frames = shard_frames(tmp_path, config)
    assert [f.height for f in frames.values()] == [100, 100, 100, 100]
    whole = pl.concat(frames.values())
    prompts = {m[-1]["content"] for m in messages_of(whole)}
    assert len(prompts) == 400
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in messages_of(whole))
    assert set(whole["source"].str.split(":").list.first()) == {"demo"}
    families = {s.split(":", 1)[1] for s in whole["source"]}
    assert families == set(demo_tasks.TASK_FAMILIES)
    trained = {example.prompt for example in demo_tasks.training_examples(0, 20000)}
    assert prompts.isdisjoint(trained)


def test_the_cite_demo_draws_its_prompts_from_the_targets_shape_and_seed(tmp_path):
    """`demo-cite`: demo_target.cite and demo_target.seed draw the prompts (another seed,
    another target of the same kind), and both decide the list's params (a change rereads it)."""

    def cite_config(seed: int, walk: list[int]) -> dict:
        return validate_config(
            {
                "seed": 0,
                "prompts": {"source": "demo-cite", "demo_pool_size": 8, "max_samples": 8},
                "demo_target": {"tasks": "cite", "seed": seed, "cite": {"walk": walk}},
            }
        )

    frame, _ = all_prompts(tmp_path / "a", cite_config(0, [100, 200]))
    texts = [m[-1]["content"] for m in messages_of(frame)]
    assert len(texts) == 8 and all("<book>" in t and "Walk the chain" in t for t in texts)
    other, _ = all_prompts(tmp_path / "b", cite_config(1, [100, 200]))
    assert [m[-1]["content"] for m in messages_of(other)] != texts
    base = prepared_params_json(cite_config(0, [100, 200]))
    assert prepared_params_json(cite_config(1, [100, 200])) != base
    assert prepared_params_json(cite_config(0, [100, 300])) != base
    # Any other source's list params are what they were before the cite demo existed.
    assert "demo_cite" not in prepared_params_json(config_for("demo"))
