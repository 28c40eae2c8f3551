"""One demo task example: the prompt, the reasoning and the answer the demo target learns (the
short suite's families in tasks.py, the long one's in long_tasks.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoExample:
    family: str
    prompt: str
    reasoning: str  # starts and ends with "\n", like the text between Qwen3's think tags
    answer: str
