"""The thinking mode: the chat-template switch a request sends and whether reasoning came back.

Reasoning targets answer in two modes, switched by a `chat_template_kwargs` key their template
reads: Qwen3's `enable_thinking`, Kimi-K2.5's (and DeepSeek-V3.1's) `thinking`, each on unless
the key is false. A drafter trained in one mode and served in the other loses about half its
acceptance (z-lab DFlash on Qwen3-8B: 25% against 60%), so every sample records the switch its
request sent and whether its answer reasoned, the tokens carry it to training, and the evaluation
decodes the held-out prompts in both modes where the template has both.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

# The keys templates read, in the order they are looked for in a request's kwargs.
SWITCH_KEYS = ("enable_thinking", "thinking")
MODES = ("on", "off")


def switch_value(kwargs: Mapping[str, Any] | None) -> bool | None:
    """The switch `kwargs` sets: the first of SWITCH_KEYS holding a boolean, None when none does
    (the template's default applies: on, for Qwen3's and Kimi-K2.5's)."""
    for key in SWITCH_KEYS:
        value = (kwargs or {}).get(key)
        if isinstance(value, bool):
            return value
    return None


def request_switch(request_json: str | None) -> bool | None:
    """The switch a raw row's request body (sorted JSON) sent in its chat_template_kwargs."""
    try:
        request = json.loads(request_json or "null")
    except json.JSONDecodeError:
        return None
    kwargs = request.get("chat_template_kwargs") if isinstance(request, dict) else None
    return switch_value(kwargs if isinstance(kwargs, dict) else None)


def reasoned(reasoning: str | None) -> bool:
    """Whether reasoning came back: the answer's reasoning text is not empty or whitespace."""
    return bool(reasoning and reasoning.strip())


def mode_name(thinking: bool | None) -> str:
    """ "on", "off", or "unknown" (a shard written before the mode was recorded)."""
    return "unknown" if thinking is None else MODES[not thinking]


def modes_of(values: Iterable[bool | None]) -> dict[str, int]:
    """Samples per mode ("on", "off", "unknown"), only those present."""
    return dict(sorted(Counter(mode_name(v) for v in values).items()))


def mode_of_data(counts: Mapping[str, int]) -> str:
    """One name for a set of samples: "on" or "off" when all are, "mixed", "unknown" when any
    sample's mode was not recorded (or there are none)."""
    present = {mode for mode, n in counts.items() if n}
    if not present or "unknown" in present:
        return "unknown"
    return present.pop() if len(present) == 1 else "mixed"


def summary(switches: Iterable[bool | None], thinking: Iterable[bool | None]) -> dict[str, Any]:
    """What a report json says of a shard's mode: samples per mode, per switch sent (`true`,
    `false`, `none`: no switch, the template's default) and the one name of the data."""
    modes = modes_of(thinking)
    sent = Counter("none" if s is None else str(s).lower() for s in switches)
    return {
        "mode": mode_of_data(modes),
        "samples": modes,
        "switch_sent": dict(sorted(sent.items())),
    }
