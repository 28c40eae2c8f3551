"""Proposers of the families that draft several tokens in ONE drafter forward, for our own live
loop (speculative.py's protocol: start / propose(k) / accept), each computing what vLLM 0.32's
proposer computes, fed the target's aux states of every verified position as vLLM feeds them.

- `PEagleProposer` (P-EAGLE: EAGLE-3 with parallel drafting). vLLM runs one drafter forward a
  round over the newly verified tokens (shifted by one, as EAGLE-3: position p takes aux_p and
  the token at p + 1; the last takes the bonus token) followed by K - 1 mask tokens whose hidden
  state is fc(mask_hidden), causally, and samples the last verified position and the K - 1
  masks (v1/spec_decode/utils.py copy_and_expand_eagle_inputs_kernel;
  llm_base_proposer.py:1402-1414 for fc(mask_hidden); one forward: `only_one_forward_pass`,
  llm_base_proposer.py:1627). The masks' keys are dropped: the next round's verified tokens
  take their positions. So `accept` only keeps the verified tokens, and `propose` runs that one
  forward.
- `DFlashProposer` (DFlash). vLLM keeps the context's keys and values of every verified position
  and queries [bonus, mask x K] once (v1/spec_decode/dflash.py;
  eaglenest.drafter.dflash.decode), K = num_speculative_tokens, which vLLM 0.32 does not tie to
  the drafter's block: any K up to block_size - 1 (the slots it was trained for) is drafted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from eaglenest.drafter.dflash.decode import DFlashContext, draft_block, extend_context
from eaglenest.drafter.layers import DecodeCache
from eaglenest.settings.families import block_served_k

if TYPE_CHECKING:  # the models are only read here (the import graph stays low)
    from eaglenest.drafter.dflash.model import DFlashDrafter
    from eaglenest.drafter.p_eagle.model import PEagleDrafter


class PEagleProposer:
    """P-EAGLE's drafter keeps the depth-0 keys of every verified position (module doc)."""

    needs_hidden = True

    def __init__(self, drafter: PEagleDrafter):
        self.drafter = drafter
        self.device = drafter.fc.weight.device

    def start(self, prompt: list[int], aux: torch.Tensor, first_token: int) -> None:
        self.cache = DecodeCache()
        self.length = 0
        # The prompt's forward here, as EagleProposer's and DFlash's starts, so that a round's
        # drafter time never holds a prefill; the first round then drafts its masks alone.
        self.first = self._forward([*prompt[1:], first_token], aux, 0)
        self.pending: tuple[list[int], torch.Tensor] | None = None

    @torch.inference_mode()
    def _forward(self, tokens: list[int], aux: torch.Tensor | None, masks: int) -> torch.Tensor:
        """One causal forward over the verified `tokens` (with their aux states) and `masks`
        mask slots after them; the LM-head inputs [1 + masks, H] of the last verified
        position (none without tokens) and the masks. The verified keys stay, the masks' go."""
        drafter, n = self.drafter, len(tokens)
        hidden = drafter.project(drafter.mask_hidden.to(self.device)).expand(1, masks, -1)
        if n:
            hidden = torch.cat([drafter.project(aux[None].to(self.device)), hidden], dim=1)
        ids = torch.tensor([[*tokens, *[drafter.mask_token_id] * masks]], device=self.device)
        positions = torch.arange(self.length, self.length + n + masks, device=self.device)[None]
        normed, _ = drafter.step_states(ids, hidden, positions, self.cache)
        self.length += n
        self.cache.truncate(self.length)  # the masks' keys (module doc)
        return normed[0, max(n - 1, 0) :]

    def propose(self, k: int) -> list[int]:
        if self.pending is None:  # the first round: its last verified position ran in start
            normed = torch.cat([self.first, self._forward([], None, k - 1)])
        else:
            normed = self._forward(*self.pending, k - 1)
        return self.drafter.draft_to_target(self.drafter.lm_head(normed).argmax(-1)).tolist()

    def accept(self, new_tokens: list[int], aux: torch.Tensor) -> None:
        self.pending = (new_tokens, aux)


class DFlashProposer:
    """DFlash's drafter keeps the context keys of every verified position (module doc)."""

    needs_hidden = True

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.k = block_served_k(drafter.config.block_size)

    def start(self, prompt: list[int], aux: torch.Tensor, first_token: int) -> None:
        self.context = DFlashContext()
        extend_context(self.drafter, self.context, aux)
        self.bonus = first_token

    def propose(self, k: int) -> list[int]:
        if not 1 <= k <= self.k:
            raise ValueError(
                f"a DFlash drafter of block_size {self.k + 1} drafts 1..{self.k} tokens a round, "
                f"not {k}"
            )
        logits = draft_block(self.drafter, self.context, self.bonus, k)
        return self.drafter.draft_to_target(logits[1:].argmax(-1)).tolist()

    def accept(self, new_tokens: list[int], aux: torch.Tensor) -> None:
        # aux: the states of the last round's input [bonus, accepted drafts], now verified.
        extend_context(self.drafter, self.context, aux)
        self.bonus = new_tokens[-1]
