"""The served check (`eaglenest check-drafter`, and the evaluate stage before vLLM starts): a
drafter's config.json against what vLLM will serve it with, beside its target, at a served
length. Each configuration cliff (DEPTH.md) is a step to an acceptance near 1 at a fixed position
that no acceptance figure at short depth shows, so it is caught from the files:

- positions below the served length where vLLM does not raise them (`raises_draft_positions`,
  by family and version: 0.32 raises an EAGLE/EAGLE-3 draft's, never a DFlash draft's,
  vllm#57941): refused.
- a rotary base or schedule unlike the target's (theta, rope type, YaRN factor and original
  positions; Kimi-K2.5's is in its text_config): refused. An unscaled draft beside a YaRN target
  accepted 0 of 19,998 drafts at a 265K prompt (vllm#37435).
- a window vLLM will not serve as trained, layer by layer, read as vLLM reads `layer_types` and
  `sliding_window` (llama.py for the EAGLE-3/P-EAGLE Llama drafter, qwen3_dflash.py for DFlash)
  against the `eaglenest` record of what was trained: refused. A DFlash trained with a 2,048
  window and served without fell to 0 past ~2K (z-lab/dflash#126).
- trained positions far below the served length (`FAR_BELOW_SHARE`): flagged, as learned decay
  is smooth and its size a measurement, not a fact of the files.

A finding is {severity, key, message}: `key` the config key that fixes it, the message naming
the drafter's file and both values. A drafter made elsewhere has no `eaglenest` record: its
window and trained positions are not checked.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eaglenest.drafter.dflash.export import SLIDING, vllm_layer_types
from eaglenest.drafter.eagle3.export import MLA_ARCHITECTURE
from eaglenest.settings.vllm_versions import MEASURED_VERSION, raises_draft_positions

REFUSE, FLAG = "refuse", "flag"
# Flagged below this share of the served length: published EAGLE-3 drafters trained at 2K fall
# from 2.30 at 2K to 1.08 at 20K (speculators#684), so a drafter that never trained half of
# the positions it serves spends most of a long answer where it decays.
FAR_BELOW_SHARE = 0.5
YARN_TYPES = ("yarn", "deepseek_yarn")  # DeepSeek-V3's configs name YaRN either way
UNSIZED = "unsized"


class DrafterRefused(ValueError):
    """A drafter vLLM would serve across a configuration cliff; the message names the key."""


@dataclass(frozen=True)
class Finding:
    severity: str  # REFUSE or FLAG
    key: str  # the config key that fixes it
    message: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def read_config(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / "config.json").read_text())


def drafter_field(config: Mapping[str, Any], key: str) -> Any:
    """A drafter config.json's field at its top, else in a speculators-format
    `transformer_layer_config` (vLLM flattens that into the top)."""
    if key in config:
        return config[key]
    return (config.get("transformer_layer_config") or {}).get(key)


def rope_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """A (text) config's rotary schedule as vLLM reads it: `rope_parameters` (transformers 5),
    else `rope_theta` + `rope_scaling` (older configs: DeepSeek-V3's, Kimi-K2.5's); type
    `type` is the older name of `rope_type`."""
    merged = {
        **(drafter_field(config, "rope_scaling") or {}),
        **(drafter_field(config, "rope_parameters") or {}),
    }
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    rope_type = "yarn" if rope_type in YARN_TYPES else rope_type
    scaled = rope_type != "default"
    return {
        "rope_theta": merged.get("rope_theta", drafter_field(config, "rope_theta")),
        "rope_type": rope_type,
        "factor": merged.get("factor") if scaled else None,
        "original_max_position_embeddings": (
            merged.get("original_max_position_embeddings") if scaled else None
        ),
    }


def family_of(config: Mapping[str, Any]) -> str:
    """The family of an export: its `eaglenest.format`, else what vLLM would take it for."""
    recorded = (config.get("eaglenest") or {}).get("format")
    if recorded:
        return recorded.split("/")[0]
    if "dflash_config" in config or any("DFlash" in a for a in config.get("architectures", [])):
        return "dflash"
    peagle = config.get("speculators_model_type") == "peagle" or config.get("parallel_drafting")
    return "p_eagle" if peagle else "eagle3"


def served_windows(config: Mapping[str, Any], family: str) -> list[int | str | None]:
    """The window vLLM 0.32 gives each draft layer (None: full attention; UNSIZED: sliding with
    no size, which vLLM refuses to start with)."""
    n = drafter_field(config, "num_hidden_layers") or 1
    if family == "dflash":  # qwen3_dflash.py _resolve_layer_attention
        nested = config.get("dflash_config") or {}
        types = vllm_layer_types(config)  # as transformers' Qwen3Config fills it
        every = bool(nested.get("use_swa")) and SLIDING not in types
        # transformers' Qwen3Config keeps sliding_window only with use_sliding_window
        default = config.get("sliding_window") if config.get("use_sliding_window") else None
        window = nested.get("swa_window_size", default)
        return [(window or UNSIZED) if every or t == SLIDING else None for t in types]
    if MLA_ARCHITECTURE in config.get("architectures", []):
        return [None] * n  # deepseek_eagle3.py reads no window
    # llama.py: a layer slides when layer_types names it, by its index among the draft's layers;
    # without layer_types no window of the drafter's.
    types = drafter_field(config, "layer_types") or []
    window = drafter_field(config, "sliding_window")
    return [window if i < len(types) and types[i] == SLIDING else None for i in range(n)]


def check_drafter(
    drafter_dir: str | Path,
    target_config: Mapping[str, Any],
    served_length: int | None = None,
    family: str | None = None,
    vllm_version: Sequence[int] = MEASURED_VERSION,
) -> list[Finding]:
    """The findings of the drafter in `drafter_dir` served beside the target whose config.json
    is `target_config` at `served_length` positions (None: the target's own) by `vllm_version`;
    `family` None: the export's own."""
    config = read_config(drafter_dir)
    where = f"{Path(drafter_dir) / 'config.json'}"
    family = family or family_of(config)
    target = target_config.get("text_config") or target_config
    served = served_length or target.get("max_position_embeddings")
    drafter_rope = rope_of(config)
    findings = position_findings(where, config, family, served, drafter_rope, vllm_version)
    findings += rope_findings(where, family, drafter_rope, rope_of(target))
    record = config.get("eaglenest") or {}
    if record.get("sliding_window") is not None:
        findings += window_findings(where, record["sliding_window"], served_windows(config, family))
    trained = record.get("trained_positions")
    if trained and served and trained < served * FAR_BELOW_SHARE:
        findings.append(
            Finding(
                FLAG,
                "train.sequence.length",
                f"{where}: trained on positions up to {trained} (eaglenest.trained_positions), "
                f"served to {served}: under {FAR_BELOW_SHARE:g} of them, where drafters trained "
                "short decay (learned, not a step); train on longer sequences",
            )
        )
    return findings


def position_findings(
    where: str,
    config: Mapping[str, Any],
    family: str,
    served: int | None,
    rope: Mapping[str, Any],
    version: Sequence[int],
) -> list[Finding]:
    positions = drafter_field(config, "max_position_embeddings")
    if served is None or (positions is not None and positions >= served):
        return []
    if raises_draft_positions(family, rope["rope_type"], version):
        return []  # vLLM sizes the draft's rotary cache to the target's max_model_len
    said = ".".join(map(str, version[:2]))
    return [
        Finding(
            REFUSE,
            "train.drafter.max_position_embeddings",
            f"{where}: max_position_embeddings {positions} is below the served length {served}, "
            f"and vLLM {said} does not raise a {family} draft's ({rope['rope_type']} rope) to "
            "the target's: positions past it fall outside the draft's rotary cache "
            "(vllm#57941); raise it, or serve less (vllm.max_model_len)",
        )
    ]


def rope_findings(
    where: str, family: str, drafter: Mapping[str, Any], target: Mapping[str, Any]
) -> list[Finding]:
    findings = []
    if drafter["rope_theta"] != target["rope_theta"]:
        findings.append(
            Finding(
                REFUSE,
                "train.drafter.rope_theta",
                f"{where}: rope_theta {drafter['rope_theta']}, the target's is "
                f"{target['rope_theta']}: the draft rotates positions otherwise than the "
                "states it reads",
            )
        )
    schedule = ("rope_type", "factor", "original_max_position_embeddings")
    differ = [k for k in schedule if drafter[k] != target[k]]
    if differ:
        # DFlash takes its schedule from the target it is trained for; EAGLE-3 and P-EAGLE
        # train with the default one only (yet).
        key = "target.path" if family == "dflash" else "train.families"
        fix = (
            "retrain it against this target (DFlash takes the target's schedule)"
            if family == "dflash"
            else "eaglenest trains EAGLE-3 and P-EAGLE unscaled: DFlash trains with the target's"
        )
        findings.append(
            Finding(
                REFUSE,
                key,
                f"{where}: rope {', '.join(f'{k} {drafter[k]}' for k in differ)}, the target's "
                f"{', '.join(f'{k} {target[k]}' for k in differ)}: the draft decays where the "
                f"target's scaling starts (vllm#37435); {fix}",
            )
        )
    return findings


def window_findings(
    where: str, trained: Sequence[int | None], served: Sequence[int | None]
) -> list[Finding]:
    if list(trained) == list(served):
        return []
    return [
        Finding(
            REFUSE,
            "train.drafter.sliding_window",
            f"{where}: trained with windows {list(trained)} (eaglenest.sliding_window, one a "
            f"layer; null: full attention), vLLM would serve {list(served)} (layer_types, "
            "sliding_window): acceptance falls past the window (z-lab/dflash#126); export it "
            "again or train with the window it is served with",
        )
    ]


def enforce(findings: Sequence[Finding], mode: str, what: str) -> list[dict[str, str]]:
    """The findings a run records (eval metrics.json `served_check`); with mode `refuse`, a
    refusal raises DrafterRefused naming every key. `what`: why it is checked, for the error."""
    refused = [f for f in findings if f.severity == REFUSE]
    if mode == REFUSE and refused:
        raise DrafterRefused(
            f"{what}: the drafter would be served across a configuration cliff "
            "(evaluate.served_check: flag measures it anyway):\n"
            + "\n".join(f"- {f.key}: {f.message}" for f in refused)
        )
    return [f.to_json() for f in findings]


# ---- `eaglenest check-drafter` ------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True, help="the drafter's directory (config.json)")
    parser.add_argument("--target", required=True, help="the target's directory or hub name")
    parser.add_argument(
        "--served-length", type=int, help="positions served (default: the target's own)"
    )
    parser.add_argument(
        "--family", choices=("eagle3", "p_eagle", "dflash"), help="default: the export's own"
    )
    parser.add_argument(
        "--vllm-version",
        default=".".join(map(str, MEASURED_VERSION)),
        help="the vLLM that will serve it, e.g. 0.33.0 (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the findings, one a line; 1 when one refuses."""
    from eaglenest.target_model.files import resolve_target_dir

    version = tuple(int(part) for part in args.vllm_version.split("."))
    target = read_config(resolve_target_dir(args.target, key="--target"))
    findings = check_drafter(args.drafter, target, args.served_length, args.family, version)
    for finding in findings:
        print(f"{finding.severity}\t{finding.key}\t{finding.message}")
    if not findings:
        print(f"{args.drafter}: no configuration cliff against {args.target}")
    return 1 if any(f.severity == REFUSE for f in findings) else 0
