"""Seeded fault injection for `eaglenest serve`.

Real endpoints fail in a handful of ways (errors, rate limits, hangs, broken bodies, dropped
connections, and, worst, normal-looking answers that lost the reasoning or carry token ids that
are not ids). The server reproduces them at configured per-request rates so clients can be
tested against all of them. One uniform draw per chat-completion request, in arrival order,
from `random.Random(seed)`: the same seed gives the same sequence of faults, and over N requests
the count of each mode is fixed whatever the concurrency (only which request gets which fault
depends on arrival order).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# The order is part of the seeded behaviour: mode k owns the k-th slice of [0, 1).
FAULT_MODES = (
    "error_500",
    "rate_limit_429",
    "hang",
    "malformed",
    "drop_connection",
    "drop_reasoning",
    "bad_token_ids",
    "stall_stream",  # last: the earlier modes keep their seeded slices
)
# Modes served as a normal-looking 200 answer, altered (the others replace the answer).
# stall_stream sends the first chunks of a streamed answer, then nothing for hang_s (a request
# that does not stream hangs for hang_s instead).
ANSWER_FAULTS = ("drop_reasoning", "bad_token_ids", "stall_stream")


@dataclass(frozen=True)
class FaultConfig:
    rates: Mapping[str, float] = field(default_factory=dict)  # mode -> probability per request
    seed: int = 0
    hang_s: float = 60.0
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.rates) - set(FAULT_MODES))
        if unknown:
            raise ValueError(f"unknown fault mode(s) {unknown}; known: {', '.join(FAULT_MODES)}")
        for mode, rate in self.rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault rate {mode}={rate} is not a probability in [0, 1]")
        if sum(self.rates.values()) > 1.0 + 1e-9:
            raise ValueError(f"fault rates add up to {sum(self.rates.values()):.3f} > 1")

    @property
    def enabled(self) -> bool:
        return any(rate > 0 for rate in self.rates.values())


class FaultInjector:
    """Draws the fault (or None) of each request and counts what was served."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self.requests_total = 0
        self.counts = {mode: 0 for mode in FAULT_MODES}

    def draw(self) -> str | None:
        """Fault mode for the next chat-completion request (None: serve it normally)."""
        self.requests_total += 1
        if not self.config.enabled:
            return None
        draw = self._rng.random()
        threshold = 0.0
        for mode in FAULT_MODES:
            threshold += self.config.rates.get(mode, 0.0)
            if draw < threshold:
                self.counts[mode] += 1
                return mode
        return None


def parse_fault_specs(specs: Iterable[str]) -> dict[str, float]:
    """Parse CLI `--fault MODE=RATE` values into {mode: rate}; a repeated mode keeps the last."""
    rates: dict[str, float] = {}
    for spec in specs:
        mode, sep, value = spec.partition("=")
        if not sep:
            raise ValueError(f"--fault expects MODE=RATE (e.g. error_500=0.1), got {spec!r}")
        mode = mode.strip()
        if mode not in FAULT_MODES:
            raise ValueError(
                f"--fault {spec!r}: unknown mode {mode!r}; known: {', '.join(FAULT_MODES)}"
            )
        try:
            rates[mode] = float(value)
        except ValueError:
            raise ValueError(f"--fault {spec!r}: rate {value!r} is not a number") from None
    return rates
