"""The evaluation in both thinking modes (`evaluate.thinking_modes: both`): the held-out prompts
as generated, and rendered with the chat template's thinking switch the other way, decoded as
one more prompt group by the same live loop and vLLM engines (common/thinking.py: why).

The other mode's prompts are the held-out prompt ids with the generation prompt's tail swapped:
the template renders one chat with the switch on and off, the two token sequences share a head,
and their tails (Qwen3: nothing against `<think>\\n\\n</think>\\n\\n`; Kimi-K2.5: `<think>`
against `<think></think>`) are what the switch changes. A prompt that ends with neither tail is
left out and counted. metrics.json `thinking` names the mode the drafter was trained in (its
training tokens' `thinking`), the held-out prompts' mode, the figures in each mode and the ratio
of the other mode's to the generated mode's.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglenest.common.thinking import SWITCH_KEYS, mode_of_data, modes_of
from eaglenest.formats.metrics import ThinkingFigures
from eaglenest.formats.tokens import read_thinking
from eaglenest.settings.thinking import ThinkingSettings
from eaglenest.target_model.encoding import encode_batch
from eaglenest.target_model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

GROUP = "thinking:"  # the prefix of the other mode's prompt group (no depth takes it)
# The chat the switch is found with: any user turn renders the same generation-prompt tail.
PROBE_CHAT = [{"role": "user", "content": "What is 1 + 1?"}]


@dataclass
class OtherMode:
    """The held-out prompts in the other mode, or why there are none (`skipped`)."""

    switch: str | None = None
    generated: str | None = None  # the held-out prompts' mode: "on" or "off"
    other: str | None = None
    prompts: list[list[int]] = field(default_factory=list)
    not_flipped: int = 0  # held-out prompts in neither mode, or not in the generated one
    skipped: str | None = None

    @property
    def group(self) -> str:
        return f"{GROUP}{self.other}"

    def groups(self) -> dict[str, list[list[int]]]:
        """The prompt group the engines and the live loop decode (none when skipped)."""
        return {self.group: self.prompts} if self.prompts else {}


def switch_tails(tokenizer: Any, kwargs: dict[str, Any], key: str) -> dict[str, list[int]] | None:
    """The generation prompt's tail ids with `key` true ("on") and false ("off"), after the head
    both share; None when the switch changes nothing the template renders."""
    texts = [
        tokenizer.apply_chat_template(
            PROBE_CHAT, add_generation_prompt=True, tokenize=False, **{**kwargs, key: on}
        )
        for on in (True, False)
    ]
    on_ids, off_ids = encode_batch(tokenizer, texts)
    if on_ids == off_ids:
        return None
    head = 0
    while head < min(len(on_ids), len(off_ids)) and on_ids[head] == off_ids[head]:
        head += 1
    return {"on": on_ids[head:], "off": off_ids[head:]}


def mode_of_prompt(prompt: list[int], tails: dict[str, list[int]]) -> str | None:
    """The mode whose tail `prompt` ends with (the longer tail first: the other may be empty)."""
    for mode in sorted(tails, key=lambda m: -len(tails[m])):
        tail = tails[mode]
        if prompt[len(prompt) - len(tail) :] == tail:
            return mode
    return None


def flip(prompts: list[list[int]], tails: dict[str, list[int]], switch: str) -> OtherMode:
    """The prompts in the mode they were generated in (read per prompt: the mode most of them
    end in, so a run generated with thinking off has "off"), each with its tail swapped to the
    other mode; prompts in neither mode or in the other are left out and counted."""
    modes = [mode_of_prompt(p, tails) for p in prompts]
    counts = Counter(m for m in modes if m is not None)
    generated = counts.most_common(1)[0][0] if counts else None
    if generated is None:
        return OtherMode(
            switch, skipped="no held-out prompt ends as the template renders either mode"
        )
    other = "off" if generated == "on" else "on"
    flipped = [
        p[: len(p) - len(tails[generated])] + tails[other]
        for p, mode in zip(prompts, modes, strict=True)
        if mode == generated
    ]
    return OtherMode(switch, generated, other, flipped, len(prompts) - len(flipped))


def other_mode(prompts: list[list[int]], settings: ThinkingSettings) -> OtherMode:
    """The held-out prompts rendered with the switch the other way (settings: which switch)."""
    if settings.modes == "generated":
        return OtherMode(skipped="evaluate.thinking_modes is generated")
    kwargs = dict(settings.target.chat_template_kwargs)
    tokenizer = load_tokenizer(settings.target)
    set_keys = [key for key in SWITCH_KEYS if key in kwargs]
    candidates = [settings.switch] if settings.switch else [*set_keys, *SWITCH_KEYS]
    for key in dict.fromkeys(candidates):
        tails = switch_tails(tokenizer, kwargs, key)
        if tails is not None:
            found = flip(prompts, tails, key)
            log.info(
                "thinking: held-out prompts %s, %d rendered %s by %s (%d left out)",
                found.generated,
                len(found.prompts),
                found.other,
                key,
                found.not_flipped,
            )
            return found
    return OtherMode(
        skipped=f"the chat template renders the same prompt with {' or '.join(candidates)} true "
        "and false: it has no such thinking switch (evaluate.thinking_switch names the key "
        "it reads)"
    )


def _per_k(figures: dict[str, Any] | None) -> dict[str, Any] | None:
    if not figures:
        return None
    keys = ("acceptance_length", "emitted_per_round", "prompts", "tokens")
    return {k: {key: each.get(key) for key in keys} for k, each in figures.items()}


def _ratios(other: dict | None, generated: dict | None) -> dict[str, float | None] | None:
    if not other or not generated:
        return None
    return {
        k: other[k]["acceptance_length"] / generated[k]["acceptance_length"]
        if k in generated and generated[k]["acceptance_length"]
        else None
        for k in other
    }


def thinking_section(
    found: OtherMode, metrics: dict[str, Any], train_tokens: list[str | Path]
) -> ThinkingFigures:
    """metrics.json `thinking`, the other mode's figures taken out of `metrics` (the live
    loop's `live_groups`, the engine's `by_depth` and its sampled `by_depth`)."""
    trained = modes_of(read_thinking(train_tokens))
    name = found.group
    engine = metrics.get("engine") or {}
    live_other = (metrics.pop("live_groups", None) or {}).get(name)
    engine_other = (engine.get("by_depth") or {}).pop(name, None)
    sampled_other = ((engine.get("sampled") or {}).get("by_depth") or {}).pop(name, None)
    modes = {}
    if found.generated:
        modes[found.generated] = {
            "prompts": "the held-out prompts",
            "live": _per_k(metrics.get("live")),
            "engine": _per_k(engine.get("per_k")),
            "sampled": _per_k((engine.get("sampled") or {}).get("per_k")),
        }
    if found.prompts:
        modes[found.other] = {
            "prompts": f"the held-out prompts rendered with {found.switch} {found.other == 'on'}",
            "live": _per_k(live_other),
            "engine": _per_k(engine_other),
            "sampled": _per_k(sampled_other),
        }
    generated, other = modes.get(found.generated) or {}, modes.get(found.other) or {}
    return ThinkingFigures(
        trained={"mode": mode_of_data(trained), "samples": trained},
        heldout_mode=found.generated,
        other_mode=found.other if found.prompts else None,
        switch=found.switch,
        other_prompts=len(found.prompts),
        not_flipped=found.not_flipped,
        skipped=found.skipped,
        modes=modes,
        # The other mode's acceptance length over the generated mode's, per K: what serving the
        # drafter in the mode it was not trained in costs (below 1: it accepts less there).
        other_vs_generated={
            way: _ratios(other.get(way), generated.get(way)) for way in ("live", "engine")
        },
    )


@dataclass
class ThinkingEvaluation:
    """The evaluate stage's part in both modes: the other mode's prompt group (`groups`, from
    the held-out prompts) and, once decoded, metrics.json's `thinking` (`section`)."""

    settings: ThinkingSettings
    train_tokens: list[str | Path]  # the drafter's training tokens: the mode it was trained in
    found: OtherMode = field(default_factory=OtherMode)

    def groups(self, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
        self.found = other_mode(prompts, self.settings)
        return self.found.groups()

    def section(self, metrics: dict[str, Any]) -> ThinkingFigures:
        return thinking_section(self.found, metrics, self.train_tokens)
