"""eaglenest: prompts to a trained EAGLE-3 drafter for a reasoning target, reproducibly."""

__version__ = "0.1.0"
