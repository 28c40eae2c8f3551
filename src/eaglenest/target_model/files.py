"""Where the target's files are: `target.path` and `target.tokenizer` as local directories.

Both keys take a local directory or a Hugging Face hub name (`Qwen/Qwen3-8B`). A hub name is
looked up in the local Hugging Face cache only (`local_files_only=True`, honouring `HF_HOME` and
`HF_HUB_CACHE`): nothing is downloaded while the pipeline runs, so a job never waits on, or fails
halfway for, the network, and every job of a run reads the same snapshot. A name missing from the
cache is an error that names the config key and the command that fetches it. A local directory
is used as it is.

Every stage that opens the target's files (tokenizer, config.json, generation_config.json,
weights) goes through `resolve_target_dir` first.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eaglenest.settings.target import TargetSettings

log = logging.getLogger(__name__)


class TargetNotFoundError(FileNotFoundError):
    """The target's files are not on this machine; the message says which key and how to fetch."""


def _looks_like_hub_name(value: str) -> bool:
    """`name` or `org/name`: what the hub accepts as a model id (paths have other shapes)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if value.startswith((".", "/", "~")) or value.count("/") > 1:
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def hub_cache_dir() -> str:
    """The cache a hub name is looked up in (read at call time: tests and jobs may point it)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_target_dir(path_or_name: str | Path, key: str = "target.path") -> Path:
    """The local directory of `path_or_name`: itself when it is a directory, else the snapshot of
    that hub name in the local Hugging Face cache. `key` is the config key it came from, for the
    error when neither exists."""
    value = str(path_or_name)
    local = Path(value).expanduser()
    if local.is_dir():
        return local
    if not _looks_like_hub_name(value):
        raise TargetNotFoundError(f"{key} '{value}': no such directory")
    from huggingface_hub import errors, snapshot_download

    try:
        snapshot = Path(snapshot_download(value, local_files_only=True))
    except errors.LocalEntryNotFoundError as err:
        # A snapshot the hub knows to be partial (newer huggingface_hub) says which files miss.
        partial = f" ({err})" if type(err).__name__ == "IncompleteSnapshotError" else ""
        raise TargetNotFoundError(
            f"{key} '{value}' is neither a local directory nor a model in the local Hugging Face "
            f"cache ({hub_cache_dir()}){partial}. Nothing is downloaded at run time: fetch it "
            f"first with `hf download {value}`, point HF_HOME or HF_HUB_CACHE at the cache that "
            f"holds it, or set {key} to its directory"
        ) from None
    log.info("%s '%s': the local Hugging Face cache's snapshot %s", key, value, snapshot)
    return snapshot


def tokenizer_dir(target: TargetSettings) -> Path | None:
    """The target's tokenizer directory (target.tokenizer, else target.path); None when neither
    is set."""
    if target.tokenizer:
        return resolve_target_dir(target.tokenizer, "target.tokenizer")
    if target.path:
        return resolve_target_dir(target.path, "target.path")
    return None
