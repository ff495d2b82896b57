"""Replicas and route weights of a red-black step (ARCHITECTURE §4), as one pure function.

The program calls `plan_red_black` for every red-black model; the rollout tool (issue 8) extends and
property-tests it. Rules:

- Without a candidate the active version has all replicas and all traffic.
- With a candidate at weight w (0..100) of a model with R replicas: the candidate gets ceil(R*w/100) replicas, at
  least one so that it passes its health checks before any traffic moves (w = 0 is the "deploy and verify" step);
  the active version gives up floor(R*w/100) replicas, the share of traffic it no longer carries.
- So the total is at most R + 1: one step of surge, never more GPUs than that (§4 "GPU count stays within the
  model's replicas plus one step of surge"), and each version has at least the replicas its weight asks for.
- Autoscaling bounds scale the same way, so the autoscaler cannot undo the split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class VersionShare:
    version: str
    replicas: int
    weight: int
    max_replicas: int


@dataclass(frozen=True)
class RedBlackPlan:
    active: VersionShare
    candidate: VersionShare | None

    @property
    def total_replicas(self) -> int:
        return self.active.replicas + (self.candidate.replicas if self.candidate else 0)

    @property
    def shares(self) -> tuple[VersionShare, ...]:
        return (self.active,) if self.candidate is None else (self.active, self.candidate)


def _scaled_max(max_replicas: int, replicas: int, share: int) -> int:
    """The autoscaler's ceiling for a version that holds `share` of the model's `replicas`."""
    if share == 0:
        return 0
    return max(share, math.ceil(max_replicas * share / replicas))


def plan_red_black(
    active: str,
    replicas: int,
    candidate: str | None = None,
    weight: int | None = None,
    max_replicas: int | None = None,
) -> RedBlackPlan:
    if replicas < 1:
        raise PlanError(f"replicas must be at least 1, got {replicas}")
    max_replicas = replicas if max_replicas is None else max_replicas
    if max_replicas < replicas:
        raise PlanError(f"max_replicas ({max_replicas}) is below replicas ({replicas})")
    if candidate is None:
        if weight not in (None, 0):
            raise PlanError(f"weight {weight} without a candidate")
        return RedBlackPlan(VersionShare(active, replicas, 100, max_replicas), None)
    if candidate == active:
        raise PlanError(f"candidate {candidate!r} is the active version")
    if weight is None or not 0 <= weight <= 100:
        raise PlanError(f"candidate weight must be 0..100, got {weight}")
    moved = replicas * weight // 100
    candidate_replicas = max(1, math.ceil(replicas * weight / 100))
    active_replicas = replicas - moved
    return RedBlackPlan(
        active=VersionShare(active, active_replicas, 100 - weight,
                            _scaled_max(max_replicas, replicas, active_replicas)),
        candidate=VersionShare(candidate, candidate_replicas, weight,
                               _scaled_max(max_replicas, replicas, candidate_replicas)),
    )
