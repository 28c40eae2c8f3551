"""Code versions change with behaviour, not with comments or docstrings."""

from pathlib import Path

import pytest

from eaglenest.code_version import code_version


def write(dir_: Path, name: str, text: str) -> None:
    (dir_ / name).write_text(text)


def test_comment_and_docstring_edits_keep_the_version(tmp_path):
    write(tmp_path, "stage.py", '"""Doc."""\n\ndef f(x):\n    return x + 1\n')
    before = code_version(["stage.py"], tmp_path)
    write(
        tmp_path,
        "stage.py",
        '"""Other doc."""\n# a comment\n\ndef f(x):\n    """Hi."""\n    return x + 1  # why\n',
    )
    assert code_version(["stage.py"], tmp_path) == before


def test_code_edits_change_the_version(tmp_path):
    write(tmp_path, "stage.py", "def f(x):\n    return x + 1\n")
    before = code_version(["stage.py"], tmp_path)
    write(tmp_path, "stage.py", "def f(x):\n    return x + 2\n")
    assert code_version(["stage.py"], tmp_path) != before


def test_non_python_files_hash_by_bytes_and_order_does_not_matter(tmp_path):
    write(tmp_path, "a.py", "x = 1\n")
    write(tmp_path, "t.jinja", "{{ x }}")
    v = code_version(["a.py", "t.jinja"], tmp_path)
    assert v == code_version(["t.jinja", "a.py"], tmp_path)
    write(tmp_path, "t.jinja", "{{ y }}")
    assert code_version(["a.py", "t.jinja"], tmp_path) != v


def test_missing_module_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        code_version(["nope.py"], tmp_path)
