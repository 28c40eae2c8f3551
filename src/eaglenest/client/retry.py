"""The retry policy of the requests the pipeline sends to a generation server: the probe's
(eaglenest.stages.probe) and generation's (eaglenest.client.chat,
eaglenest.stages.generate.generate). One backoff: exponential from `backoff_base_s`, capped at
`backoff_max_s`, with jitter, and never shorter than what the server asked for (`Retry-After`, up
to a cap). `RETRYABLE_STATUS`, the HTTP statuses worth another attempt, is also what the capture
pool moves a sample to another server on (eaglenest.capture.faults, which bounds its own waits),
and the capture pool backs off an overloaded server with a RetryPolicy and `retry_after_s` too."""

from __future__ import annotations

import datetime
import email.utils
import random
import time
from dataclasses import dataclass

# Busy, wait: rate limiting (429), overload (503), and what a gateway or ingress in front of a
# busy server answers (502, 504). Generation retries them; the capture pool waits them out
# (backs the server off, within vllm.capture_wait_s) instead of setting the server aside.
BUSY_STATUS = frozenset({429, 502, 503, 504})
# Statuses of a server that may answer on another attempt: busy, a timeout or a restart. Any
# other status is the request's fault and is not retried.
RETRYABLE_STATUS = BUSY_STATUS | {408, 500}
# 2**60 times any base the schema allows is still a finite float; past it the backoff is at its
# cap anyway (2**1024 overflows a float: a server refusing for hours reached it).
MAX_DOUBLINGS = 60


@dataclass(frozen=True)
class RetryPolicy:
    """How often to ask and how long to wait between attempts."""

    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float
    retry_after_max_s: float = 0.0  # 0: a server's Retry-After is not honoured

    def backoff_s(self, attempt: int, server_wait_s: float | None = None) -> float:
        """Seconds to wait after failed attempt `attempt` (1-based)."""
        doublings = min(max(attempt - 1, 0), MAX_DOUBLINGS)
        backoff = min(self.backoff_max_s, self.backoff_base_s * 2**doublings)
        backoff *= random.uniform(0.5, 1.5)  # jitter: retries of a burst do not arrive together
        # A server's wait is honoured up to a cap: one odd header must not park a worker for hours.
        return max(backoff, min(server_wait_s or 0.0, self.retry_after_max_s))

    def retries(self, attempt: int) -> bool:
        """Is there another attempt after attempt `attempt`?"""
        return attempt < self.max_attempts


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds a `Retry-After` header asks to wait: delay-seconds or an HTTP date (RFC 9110);
    None when absent or unreadable. Capping is the caller's."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # an obsolete date form without a zone: HTTP dates are GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
