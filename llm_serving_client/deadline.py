"""A call's deadline: one monotonic instant that every attempt's timeout is taken from (docs/clients.md, "Calls")."""

from __future__ import annotations

import time
from dataclasses import dataclass

from llm_serving_client.errors import DeadlineExceeded


@dataclass(frozen=True)
class Deadline:
    at: float  # time.monotonic() when the call must have its answer

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        if seconds <= 0:
            raise ValueError(f"a deadline is a positive number of seconds, got {seconds!r}")
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def timeout(self, model: str, version: str | None) -> float:
        """What is left for the next attempt; raises once nothing is (an attempt never starts after the deadline)."""
        left = self.remaining()
        if left <= 0:
            raise DeadlineExceeded(f"the deadline passed {-left:.3f} s ago, before the attempt", model=model,
                                   version=version)
        return left
