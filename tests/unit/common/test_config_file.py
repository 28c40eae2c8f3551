"""Careless config files refused naming the file (common/config_file.py): a key written twice,
bytes that are not UTF-8, an alias bomb, nesting thousands deep, an alias inside its own anchor;
and the same bounds on a config built in memory (as Snakemake's own loader builds it), through
validate_config. Training sizes and the run's name bounded by the schema."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from eaglenest.common.config import ConfigError, merged_config, validate_config
from eaglenest.common.config_file import MAX_DEPTH, MAX_VALUES, read_config_file

REPO = Path(__file__).resolve().parents[3]
DEMO = str(REPO / "config" / "config.yaml")


def refused(tmp_path: Path, text: str | bytes) -> str:
    """The ConfigError of merging `text` as a config file over the demo's, within 20 s."""
    path = tmp_path / "mine.yaml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    found: list[BaseException] = []

    def merge() -> None:
        try:
            merged_config([DEMO, str(path)])
        except BaseException as err:  # noqa: BLE001 - whatever it raised is the finding
            found.append(err)

    worker = threading.Thread(target=merge, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "reading the config did not end within 20 s"
    assert found and isinstance(found[0], ConfigError), found
    assert f"config file {path}" in str(found[0])
    return str(found[0])


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("train:\n  epochs: 1\nprobe:\n  max_tokens: 8\ntrain:\n  lr: 0.1\n", "'train' written"),
        (
            "train:\n  epochs: 1\n  epochs: 2\n",
            "key 'epochs' written twice in one mapping (lines 2",
        ),
        ("train: {epochs: 1, epochs: 2}\n", "key 'epochs' written twice"),
    ],
)
def test_a_key_written_twice_is_refused_naming_it(tmp_path: Path, text: str, says: str):
    assert says in refused(tmp_path, text)


def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path: Path):
    assert "not UTF-8 (invalid continuation byte at byte 8)" in refused(tmp_path, b"run: caf\xe9\n")


def alias_bomb(levels: int = 9) -> list[str]:
    """Each anchor a list of ten aliases of the one before: 10^levels values from 10 lines."""
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return lines


def test_an_alias_bomb_is_refused_before_it_is_walked(tmp_path: Path):
    # extra_body takes any mapping: the schema passes it, the finite-number check walked it.
    text = "generation:\n  extra_body:\n" + "".join(f"    {line}\n" for line in alias_bomb())
    assert f"expands to more than {MAX_VALUES:,} values" in refused(tmp_path, text)
    assert "config key 'generation.extra_body.a" in refused(tmp_path, text)


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path: Path):
    text = "generation:\n  extra_body:\n    loop: &x [1, *x]\n"
    assert "'generation.extra_body.loop[1]': refers to itself" in refused(tmp_path, text)


@pytest.mark.parametrize("flow", [True, False], ids=["flow", "block"])
def test_nesting_thousands_deep_is_refused_naming_the_file(tmp_path: Path, flow: bool):
    if flow:
        text = "generation:\n  extra_body:\n    x: " + "[" * 3000 + "]" * 3000 + "\n"
    else:
        deep = "".join("  " * (i + 2) + f"k{i}:\n" for i in range(3000))
        text = "generation:\n  extra_body:\n" + deep + "  " * 3002 + "x: 1\n"
    assert "nest" in refused(tmp_path, text)  # libyaml's bound or ours, by where it is met
    text = "generation:\n  extra_body:\n    x: " + "[" * 40 + "]" * 40 + "\n"
    assert f"nested more than {MAX_DEPTH} levels deep" in refused(tmp_path, text)


def test_anchors_and_aliases_within_the_bounds_still_read(tmp_path: Path):
    path = tmp_path / "mine.yaml"
    path.write_text("generation:\n  extra_body: &body {top_k: 20}\nserver:\n  seed: 3\n")
    assert read_config_file(path)["generation"]["extra_body"] == {"top_k": 20}
    path.write_text("")
    assert read_config_file(path) == {}


def validate(value) -> str:
    with pytest.raises(ConfigError) as raised:
        validate_config({"generation": {"extra_body": {"x": value}}})
    return str(raised.value)


def test_a_config_built_in_memory_is_held_to_the_same_bounds():
    """As Snakemake's own loader builds it: shared lists (its aliases) and deep nesting reach
    validate_config without passing read_config_file."""
    deep: dict = {}
    inner = deep
    for _ in range(3000):
        inner["k"] = inner = {}
    assert "'generation.extra_body.x.k.k" in validate(deep) and "levels deep" in validate(deep)
    bomb: list = [1.0] * 10
    for _ in range(8):
        bomb = [bomb] * 10
    assert f"expands to more than {MAX_VALUES:,} values" in validate(bomb)
    loop: list = [1]
    loop.append(loop)
    assert "'generation.extra_body.x[1]': refers to itself" in validate(loop)


def test_the_demo_and_every_example_config_read_within_the_bounds():
    for path in [REPO / "config" / "config.yaml", *sorted(REPO.glob("config/*/*.yaml"))]:
        assert read_config_file(path) == (yaml.safe_load(path.read_text()) or {}), path
