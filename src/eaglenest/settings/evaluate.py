"""Settings of the evaluate stage: the `evaluate` section, the seed of the run's training (the
untrained baseline, the batch order and the engine's sampled decoding draw from it) and, with
the engine, the generation temperature it samples at."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglenest.settings import Settings
from eaglenest.settings.compared_drafters import check_compared_directory
from eaglenest.settings.families import family_spec
from eaglenest.settings.target import TargetSettings
from eaglenest.settings.vllm import VllmEngine

if TYPE_CHECKING:
    from typing_extensions import Self


@dataclass(frozen=True)
class EvaluateSettings(Settings):
    ks: tuple[int, ...]
    depths: tuple[int, ...]  # generated depths of the by-depth table (empty: none)
    live: bool
    live_prompts: int
    live_max_new_tokens: int
    device: str  # "auto" (eaglenest.common.devices.resolve_device) or a torch device
    prompt_lookup_ngram: int
    max_batch_tokens: int
    seed: int  # train.seed
    engine: str | None  # "vllm": also decode in the serving engine
    # refuse, flag or off: the served check before vLLM decodes (drafter/served_check.py)
    served_check: str
    # generation.temperature, with engine "vllm" only (its sampled figures; None otherwise, so a
    # change reruns the evaluation only where it is measured)
    sampled_temperature: float | None
    vllm: VllmEngine | None  # with engine "vllm" only: a vllm section change reruns only then
    target: TargetSettings  # path and trust_remote_code

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EvaluateSettings:
        section = config["evaluate"]
        fixed = ("ks", "depths", "seed", "vllm", "target", "sampled_temperature", "served_check")
        names = [f for f in cls.__dataclass_fields__ if f not in fixed]
        return cls(
            ks=tuple(section["ks"]),
            depths=tuple(section["depths"]),
            seed=config["train"]["seed"],
            sampled_temperature=(
                config["generation"]["temperature"] if section["engine"] == "vllm" else None
            ),
            vllm=VllmEngine.from_config(config) if section["engine"] == "vllm" else None,
            target=TargetSettings.view(config, "path", "trust_remote_code"),
            served_check=section["served_check"] or "off",  # YAML reads an unquoted off as false
            **{k: section[k] for k in names},
        )


@dataclass(frozen=True)
class PlainSettings(Settings):
    """What the run's plain decoding in vLLM reads (the rule decode_plain, once per run for every
    evaluation: stages/evaluate/plain.py): the fields of EvaluateSettings its request is made of,
    no K, so a change of evaluate.ks (or of anything else it does not read) reruns the K engines'
    jobs only."""

    depths: tuple[int, ...]
    live_prompts: int
    live_max_new_tokens: int
    device: str
    seed: int  # train.seed
    sampled_temperature: float | None  # generation.temperature (the sampled figures)
    vllm: VllmEngine
    target: TargetSettings  # path and trust_remote_code

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        evaluate = EvaluateSettings.from_config(config)
        fields = {name: getattr(evaluate, name) for name in cls.__dataclass_fields__}
        # the vllm section whatever evaluate.engine says: these jobs exist only with vLLM
        return cls(**{**fields, "vllm": VllmEngine.from_config(config)})


@dataclass(frozen=True)
class CompareSettings(PlainSettings):
    """What a drafter of evaluate.compare is decoded with: the prompts, depths, K and sampling of
    the run's own drafter in vLLM (the fields of EvaluateSettings that the engine reads): the
    plain decoding's and the K."""

    ks: tuple[int, ...]


def compare_drafters(config: Mapping[str, Any]) -> dict[str, str]:
    """`evaluate.compare`: name -> the directory of a drafter trained elsewhere ({} when none).
    Not a field of EvaluateSettings: a drafter added there runs its own job, rerunning nothing."""
    return dict((config.get("evaluate") or {}).get("compare") or {})


def check_compare(config: Mapping[str, Any], workdir: str | Path = ".") -> None:
    """What the schema cannot say of `evaluate.compare`: the drafters are decoded in vLLM only
    (evaluate.engine: vllm), and each directory holds a drafter vLLM would serve
    (settings/compared_drafters.py). Raises ValueError naming the key."""
    drafters = compare_drafters(config)
    if drafters and (config.get("evaluate") or {}).get("engine") != "vllm":
        raise ValueError(
            "config key 'evaluate.compare': drafters trained elsewhere are decoded in vLLM only; "
            "set evaluate.engine: vllm (or remove evaluate.compare)"
        )
    for name, directory in drafters.items():
        check_compared_directory(name, directory, workdir)


def evaluate_job_settings_json(evaluate: str, config: Mapping[str, Any], family: str) -> str:
    """The evaluate rule's `settings` param for one family's job, from EvaluateSettings' JSON
    (`evaluate`): that for EAGLE-3 (every evaluate.ks), else with the ks the family is measured
    at (its spec's `served_ks`, settings/families.py), so a change of evaluate.ks that leaves
    them as they were reruns none of its evaluation: P-EAGLE's up to its trained depths (else
    its depths), DFlash's up to block_size - 1. Its metrics' `configured_ks` are these."""
    spec = family_spec(family)
    if spec.settings is None:  # EAGLE-3's: the evaluate section whole, as always
        return evaluate
    settings = EvaluateSettings.from_json(evaluate)
    trained = spec.settings.from_config(config).trained_size()
    return replace(settings, ks=spec.served_ks(settings.ks, trained)).to_json()
