"""The drafter families the evaluate stage measures (settings/families.py's specs): each one's
loader (LOADERS), the K it serves at (its spec's `served_ks`), its live proposer (PROPOSERS) and
vLLM's `speculative_config` for it.

- eagle3: every `evaluate.ks`, drafted in K forwards.
- p_eagle: the `evaluate.ks` up to the depths it was trained for (one forward a round; vLLM
  would draft more, from masks it never learnt), else its trained depths.
- dflash: the `evaluate.ks` up to block_size - 1, else block_size - 1: vLLM 0.32 drafts any
  num_speculative_tokens K with a DFlash drafter, one forward of [bonus, mask x K] (no check
  against the drafter's block: config/speculative.py, v1/spec_decode/dflash.py); slots past
  block_size - 1 were never trained. A drafter with the target's head (`head` target) takes the
  target's LM head from the target head file, as vLLM shares the target's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eaglenest.drafter.dflash.export import dflash_speculative_config, load_dflash
from eaglenest.drafter.eagle3.export import load_drafter
from eaglenest.drafter.p_eagle.export import load_p_eagle, p_eagle_speculative_config
from eaglenest.settings.families import FAMILY_SPECS, FamilySpec, block_served_k, family_spec
from eaglenest.stages.evaluate.parallel_proposers import DFlashProposer, PEagleProposer
from eaglenest.stages.evaluate.speculative import EagleProposer, Proposer

if TYPE_CHECKING:
    from eaglenest.stages.evaluate.simulated import Drafter

# family -> its live proposer of a loaded drafter (a fresh one a set of runs)
PROPOSERS: dict[str, Callable[[Any], Proposer]] = {
    "eagle3": EagleProposer,
    "p_eagle": PEagleProposer,
    "dflash": DFlashProposer,
}


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
        return PROPOSERS[self.family](self.model)

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
    method = FAMILY_SPECS["eagle3"].vllm_method
    return {"method": method, "model": str(drafter_dir), "num_speculative_tokens": k}


def load_eagle3_family(
    spec: FamilySpec,
    drafter_dir: str | Path,
    embed: torch.Tensor,
    expect: list[int] | None,
    ks: tuple[int, ...],
    lm_head: torch.Tensor | None = None,
) -> FamilyDrafter:
    model = load_drafter(drafter_dir, embed, expect_layer_ids=expect)
    why = "evaluate.ks: EAGLE-3 drafts any K, one forward a token"
    return FamilyDrafter(
        spec.name, model, spec.served_ks(ks, None), ks, why, eagle3_speculative_config
    )


def load_p_eagle_family(
    spec: FamilySpec,
    drafter_dir: str | Path,
    embed: torch.Tensor,
    expect: list[int] | None,
    ks: tuple[int, ...],
    lm_head: torch.Tensor | None = None,
) -> FamilyDrafter:
    model, depths = load_p_eagle(drafter_dir, embed, expect)
    why = f"evaluate.ks up to the {depths} depths P-EAGLE was trained for, in one forward"

    def config_of(path: str | Path, k: int) -> dict[str, Any]:
        return p_eagle_speculative_config(path, k, depths)

    return FamilyDrafter(spec.name, model, spec.served_ks(ks, depths), ks, why, config_of)


def load_dflash_family(
    spec: FamilySpec,
    drafter_dir: str | Path,
    embed: torch.Tensor,
    expect: list[int] | None,
    ks: tuple[int, ...],
    lm_head: torch.Tensor | None = None,
) -> FamilyDrafter:
    model = load_dflash(drafter_dir, embed, expect, lm_head=lm_head)
    k = block_served_k(model.config.block_size)
    why = f"evaluate.ks up to block_size - 1 = {k}: vLLM drafts DFlash's block at any K to it"

    def block_config_of(path: str | Path, served_k: int) -> dict[str, Any]:
        return dflash_speculative_config(path, model.config, served_k)

    served = spec.served_ks(ks, model.config.block_size)
    return FamilyDrafter(spec.name, model, served, ks, why, block_config_of)


# family -> the loader of its export (each refuses a config vLLM would read as another drafter
# than the one trained, and aux layers other than captured)
LOADERS: dict[str, Callable[..., FamilyDrafter]] = {
    "eagle3": load_eagle3_family,
    "p_eagle": load_p_eagle_family,
    "dflash": load_dflash_family,
}


def load_family(
    family: FamilySpec | str,
    drafter_dir: str | Path,
    embed: torch.Tensor,
    expect_layer_ids: list[int] | None,
    ks: tuple[int, ...],
    lm_head: torch.Tensor | None = None,
) -> FamilyDrafter:
    """The export in `drafter_dir` read with its family's loader (LOADERS), at the K its spec
    serves of `ks` (`family`: a spec, or its name). `lm_head`: the target's [V, H], for a
    drafter that shares it (DFlash's `head` target); the others' loaders never read it."""
    spec = family_spec(family)
    return LOADERS[spec.name](spec, drafter_dir, embed, expect_layer_ids, ks, lm_head)
