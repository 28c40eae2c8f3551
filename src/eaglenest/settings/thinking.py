"""Settings of the evaluation in both thinking modes (`evaluate.thinking_modes`,
`evaluate.thinking_switch`): the evaluate rule's `thinking` param, apart from EvaluateSettings,
so choosing the modes reruns only the evaluation, and the chat template they are rendered with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings
from eaglenest.settings.target import TargetSettings

THINKING_MODES = ("both", "generated")


@dataclass(frozen=True)
class ThinkingSettings(Settings):
    """`modes`: "both" (the held-out prompts as generated and, where the chat template has a
    thinking switch, rendered with it the other way) or "generated" (as generated only);
    `switch`: the chat_template_kwargs key the template reads (None: the one
    target.chat_template_kwargs sets, else the first of enable_thinking, thinking that changes
    the template's generation prompt)."""

    modes: str
    switch: str | None
    target: TargetSettings  # path, tokenizer, trust_remote_code, chat_template_kwargs

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ThinkingSettings:
        section = config["evaluate"]
        return cls(
            modes=section["thinking_modes"],
            switch=section["thinking_switch"],
            target=TargetSettings.view(
                config, "path", "tokenizer", "trust_remote_code", "chat_template_kwargs"
            ),
        )
