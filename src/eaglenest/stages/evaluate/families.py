"""The drafter families the evaluate stage measures (`family`: eagle3, p_eagle, dflash): each
one's loader, the K it serves at, its live proposer and vLLM's `speculative_config` for it.

- eagle3: every `evaluate.ks`, drafted in K forwards.
- p_eagle: the `evaluate.ks` up to the depths it was trained for (one forward a round; vLLM
  would draft more, from masks it never learnt), else its trained depths.
- dflash: K = block_size - 1 only, whatever `evaluate.ks` says: vLLM serves a DFlash drafter
  at num_speculative_tokens = block_size - 1 (the bonus token takes the block's first slot,
  v1/spec_decode/dflash.py), so no other K is measured in any of the three ways.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eaglenest.drafter import dflash_export, p_eagle
from eaglenest.drafter.export import load_drafter
from eaglenest.stages.evaluate.parallel_proposers import DFlashProposer, PEagleProposer
from eaglenest.stages.evaluate.speculative import EagleProposer, Proposer

if TYPE_CHECKING:
    from eaglenest.stages.evaluate.simulated import Drafter

FAMILIES = ("eagle3", "p_eagle", "dflash")


@dataclass
class FamilyDrafter:
    """A loaded drafter of one family and how it is served."""

    family: str
    model: Drafter
    ks: tuple[int, ...]  # the K it is measured at
    configured_ks: tuple[int, ...]  # evaluate.ks
    served: str  # why ks is what it is, for metrics.json
    speculative_config: Callable[[str | Path, int], dict[str, Any]]  # (drafter dir, K)

    def proposer(self) -> Proposer:
        """A fresh live proposer (one a set of runs: it keeps the drafter's cache)."""
        if self.family == "p_eagle":
            return PEagleProposer(self.model)
        if self.family == "dflash":
            return DFlashProposer(self.model)
        return EagleProposer(self.model)

    def to(self, device: str) -> FamilyDrafter:
        self.model = self.model.to(device).eval()
        return self

    def describe(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "ks": list(self.ks),
            "configured_ks": list(self.configured_ks),
            "served_ks": self.served,
        }


def eagle3_speculative_config(drafter_dir: str | Path, k: int) -> dict[str, Any]:
    return {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": k}


def load_family(
    family: str,
    drafter_dir: str | Path,
    embed: torch.Tensor,
    expect_layer_ids: list[int] | None,
    ks: tuple[int, ...],
) -> FamilyDrafter:
    """The export in `drafter_dir` read with its family's loader (each refuses a config vLLM
    would read as another drafter than the one trained, and aux layers other than captured)."""
    if family == "eagle3":
        model = load_drafter(drafter_dir, embed, expect_layer_ids=expect_layer_ids)
        why = "evaluate.ks: EAGLE-3 drafts any K, one forward a token"
        return FamilyDrafter(family, model, ks, ks, why, eagle3_speculative_config)
    if family == "p_eagle":
        model, depths = p_eagle.load_p_eagle(drafter_dir, embed, expect_layer_ids)
        served = tuple(k for k in ks if k <= depths) or (depths,)
        why = f"evaluate.ks up to the {depths} depths P-EAGLE was trained for, in one forward"

        def config_of(path: str | Path, k: int) -> dict[str, Any]:
            return p_eagle.speculative_config(path, k, depths)

        return FamilyDrafter(family, model, served, ks, why, config_of)
    if family == "dflash":
        model = dflash_export.load_dflash(drafter_dir, embed, expect_layer_ids)
        k = model.config.block_size - 1
        why = f"block_size - 1 = {k} only: vLLM serves DFlash at that K, one forward a block"

        def block_config_of(path: str | Path, served_k: int) -> dict[str, Any]:
            if served_k != k:
                raise ValueError(f"a DFlash drafter of block_size {k + 1} serves K = {k} only")
            return dflash_export.speculative_config(path, model.config)

        return FamilyDrafter(family, model, (k,), ks, why, block_config_of)
    raise ValueError(f"drafter family {family!r}: one of {', '.join(FAMILIES)}")
