"""`eaglenest --help` reads in whole sentences: its description and every command's line start
with a capital and end with a full stop (it used to open with half of the module docstring's
first sentence)."""

from __future__ import annotations

import re

import pytest

from eaglenest.cli import DESCRIPTION, SUBCOMMANDS, main


def sentences(text: str) -> bool:
    return bool(re.fullmatch(r"[A-Z`].*[.)]", text.strip(), flags=re.DOTALL)) and text.endswith(".")


def test_the_description_and_every_command_line_are_whole_sentences():
    assert sentences(DESCRIPTION), DESCRIPTION
    for name, (_, help_text) in SUBCOMMANDS.items():
        assert sentences(help_text), f"{name}: {help_text!r}"


def test_help_prints_them(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert " ".join(DESCRIPTION.split()) in printed
    assert "that module" not in printed  # the half sentence it opened with
