"""Retries only where they are safe (docs/clients.md, "Calls"): an `Unavailable` error, on a call that may be
repeated, while no output has reached the caller and the deadline leaves time. Everything else goes to the caller
as it came."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from llm_serving_client.deadline import Deadline
from llm_serving_client.errors import CallError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3
    backoff_s: float = 0.05  # before the 2nd attempt; doubled for each next one

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts is at least 1, got {self.max_attempts}")


def call_with_retries(attempt: Callable[[int], T], *, policy: RetryPolicy, deadline: Deadline, safe: bool,
                      on_retry: Callable[[int, CallError], None] | None = None) -> T:
    """Run `attempt(n)` (n = 1, 2, ...) until it answers. A retryable error is retried only when `safe` (the caller
    says the call is idempotent, or that no output was delivered: see `Unavailable`) and time is left."""
    n = 1
    while True:
        try:
            return attempt(n)
        except CallError as err:
            pause = policy.backoff_s * 2 ** (n - 1)
            if not (safe and err.retryable and n < policy.max_attempts and deadline.remaining() > pause):
                raise
            if on_retry is not None:
                on_retry(n, err)
            time.sleep(pause)
            n += 1
