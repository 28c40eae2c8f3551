"""Settings of the evaluation sets (`evaluate.sets`): one object per set, so that editing one
set's entry rereads that set only, and the config check that the schema cannot express (names
unique, the file present, a known suffix), naming the key and the entry."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eaglenest.settings import Settings
from eaglenest.settings.target import TargetSettings

# The formats a set's file can be read as (eaglenest.stages.eval_sets.formats); "auto" reads it
# from the file: its suffix and its columns.
EVAL_SET_FORMATS = ("auto", "mt_bench", "gsm8k", "humaneval", "speed_bench", "plain")
EVAL_SET_SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class EvalSetSettings:
    """One entry of `evaluate.sets`. Not a `Settings` (whose `from_config` gives one object per
    config): a rule's job gets the entry of its own `{set}`, so editing one set rereads only it."""

    name: str  # the set's name: results/{run}/eval_sets/{name}.parquet, the figures' label
    path: str  # as the config gave it, relative to the working directory
    format: str  # one of EVAL_SET_FORMATS

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EvalSetSettings:
        return cls(**json.loads(text))


def eval_set_entries(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list((config.get("evaluate") or {}).get("sets") or [])


def eval_set_names(config: Mapping[str, Any]) -> list[str]:
    """The names of `evaluate.sets`, in config order ([] when the run has none)."""
    return [entry["name"] for entry in eval_set_entries(config)]


def eval_set_settings(config: Mapping[str, Any], name: str) -> EvalSetSettings:
    """The settings of the set named `name` of a validated config."""
    for entry in eval_set_entries(config):
        if entry["name"] == name:
            return EvalSetSettings(entry["name"], entry["path"], entry.get("format", "auto"))
    raise KeyError(f"evaluate.sets has no set named {name!r}")


def check_eval_sets(config: Mapping[str, Any], workdir: str | Path = ".") -> None:
    """What the schema cannot say of `evaluate.sets`: names unique, each file present (relative
    paths from the working directory, where Snakemake runs) and of a suffix a reader knows. Raises
    ValueError naming the key `evaluate.sets[i]` and the set."""
    seen: dict[str, int] = {}
    for index, entry in enumerate(eval_set_entries(config)):
        key = f"config key 'evaluate.sets[{index}]' (set {entry['name']!r})"
        if entry["name"] in seen:
            raise ValueError(
                f"{key}: the name is already used by evaluate.sets[{seen[entry['name']]}]; "
                "each set needs its own name (it names its file and its figures)"
            )
        seen[entry["name"]] = index
        path = Path(workdir) / entry["path"]
        if path.is_symlink() and not path.exists():
            # resolve() of a link loop raises RuntimeError itself: name the link instead
            raise ValueError(
                f"{key}: {entry['path']} is a symbolic link to nothing readable (a loop, or its "
                f"target is gone: {os.readlink(path)})"
            )
        if not path.is_file():
            raise ValueError(
                f"{key}: file not found: {entry['path']} (from the working directory: "
                f"{os.path.abspath(path)}); sets are read from local files, never downloaded at "
                "run time (docs/evaluate.md says how to fetch each one once)"
            )
        if not entry["path"].lower().endswith(EVAL_SET_SUFFIXES):
            raise ValueError(
                f"{key}: {entry['path']} is not one of {', '.join(EVAL_SET_SUFFIXES)}; save the "
                "set as JSON Lines or parquet (docs/evaluate.md)"
            )


@dataclass(frozen=True)
class SetDecodeSettings(Settings):
    """What the evaluate stage decodes the sets with (the param `sets` of decode_plain,
    evaluate_drafter and evaluate_compare, absent when evaluate.sets is empty, so a run without sets keeps its params):
    the sets' names, in config order, and how the target renders a chat, as generation renders
    its prompts (the tokenizer's chat template with target.chat_template_kwargs)."""

    names: tuple[str, ...]
    target: TargetSettings  # path, tokenizer, trust_remote_code, chat_template_kwargs

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SetDecodeSettings:
        return cls(
            names=tuple(eval_set_names(config)),
            target=TargetSettings.view(
                config, "path", "tokenizer", "trust_remote_code", "chat_template_kwargs"
            ),
        )


@dataclass(frozen=True)
class EvalSetLimits(Settings):
    """What every turn of a set must fit, checked when the set is prepared, before any training
    (the param `limits` of prepare_eval_set): its prompt as the target's chat template renders
    it, after the earlier turns' answers, plus the tokens the evaluation generates, within the
    target's positions, or vllm.max_model_len where the user fixed it."""

    max_new_tokens: int  # evaluate.live_max_new_tokens: what the engine generates per turn
    max_model_len: int | None  # vllm.max_model_len (None: the target's positions bound it)
    target: TargetSettings  # path, tokenizer, trust_remote_code, chat_template_kwargs

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EvalSetLimits:
        return cls(
            max_new_tokens=config["evaluate"]["live_max_new_tokens"],
            max_model_len=config["vllm"]["max_model_len"],
            target=TargetSettings.view(
                config, "path", "tokenizer", "trust_remote_code", "chat_template_kwargs"
            ),
        )
