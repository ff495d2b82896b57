"""Replicas and route weights of a red-black step (docs/architecture.md §4), as one pure function.

The program calls `plan_red_black` for every red-black model; the rollout tool extends and
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

import functools
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


# -- red-black schedules (the rollout tool) ------------------------------------------------------------------------
#
# Inside one update the candidate scales up before the active scales down (serving.py's dependencies), so for a
# moment both hold their larger replica count: moving from weight w1 to w2 peaks at
# candidate(w2) + active(w1). `surge` bounds that peak at replicas + surge; a step of the operator's list that would
# exceed it is split into the largest smaller steps that fit, each its own update.

DEFAULT_STEPS = (10, 25, 50, 100)


def check_steps(steps: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """A step list: strictly increasing weights in 1..100 that end at 100."""
    steps = tuple(steps)
    if not steps:
        raise PlanError("steps: at least one weight is needed (the last must be 100)")
    bad = [s for s in steps if not isinstance(s, int) or not 1 <= s <= 100]
    if bad:
        raise PlanError(f"steps: every weight must be an integer in 1..100, got {bad}")
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise PlanError(f"steps: weights must strictly increase, got {list(steps)}")
    if steps[-1] != 100:
        raise PlanError(f"steps: the last weight must be 100 (all traffic on the candidate), got {list(steps)}")
    return steps


def candidate_replicas(replicas: int, weight: int) -> int:
    """The candidate's replicas at `weight`: plan_red_black's rule in integer arithmetic (schedules call it often)."""
    return max(1, -(-replicas * weight // 100))


def active_replicas(replicas: int, weight: int | None) -> int:
    """The active version's replicas at `weight` (None: no candidate, all replicas)."""
    return replicas if weight is None else replicas - replicas * weight // 100


def transition_peak(replicas: int, from_weight: int | None, to_weight: int) -> int:
    """Replicas running at the worst moment of the update from `from_weight` (None: no candidate yet) to
    `to_weight`: the candidate has grown, the active has not shrunk yet."""
    before_candidate = 0 if from_weight is None else candidate_replicas(replicas, from_weight)
    after_candidate = candidate_replicas(replicas, to_weight)
    return max(before_candidate, after_candidate) + max(active_replicas(replicas, from_weight),
                                                         active_replicas(replicas, to_weight))


def rollback_peak(replicas: int, weight: int) -> int:
    """A rollback is one update, capacity first: the active version is back at all replicas while the candidate
    still serves its share, then the route moves, then the candidate is removed. Its peak is replicas plus the
    candidate's replicas (not bounded by `surge`: a rollback trades the bound for getting traffic off the candidate
    in one update; from the usual early steps that is one replica)."""
    return replicas + candidate_replicas(replicas, weight)


@functools.lru_cache(maxsize=4096)
def _path(replicas: int, current: int | None, target: int, surge: int) -> tuple[int, ...] | None:
    """The fewest updates from `current` to `target` whose every transition stays within replicas + surge
    (breadth-first over the integer weights in between, larger weights tried first), or None."""
    bound = replicas + surge
    start = 0 if current is None else current
    previous: dict[int | None, int | None] = {current: None}
    frontier: list[int | None] = [current]
    while frontier:
        following: list[int | None] = []
        for here in frontier:
            low = start + 1 if here is None else here + 1
            for weight in range(target, low - 1, -1):
                if weight in previous or transition_peak(replicas, here, weight) > bound:
                    continue
                previous[weight] = here  # type: ignore[assignment]
                if weight == target:
                    path = [weight]
                    while previous[path[-1]] != current:
                        path.append(previous[path[-1]])  # type: ignore[arg-type]
                    return tuple(path[::-1])
                following.append(weight)
        frontier = following
    return None


def next_weight(replicas: int, current: int | None, steps: tuple[int, ...] | list[int] = DEFAULT_STEPS,
                surge: int = 1) -> int:
    """The candidate weight of the next update: the next operator step after `current` (None: the rollout
    starts), or the first weight of the shortest way there whose every update stays within replicas + surge."""
    steps = check_steps(steps)
    if surge < 1:
        raise PlanError(f"surge must be at least 1 (the candidate needs a replica before traffic moves), got {surge}")
    if current == 100:
        raise PlanError("the candidate already has all the traffic: the next update finalizes, not a weight step")
    target = next(s for s in steps if current is None or s > current)
    path = _path(replicas, current, target, surge)
    if path is None:
        enough = next(s for s in range(surge + 1, replicas + 2) if _path(replicas, current, target, s) is not None)
        raise PlanError(f"surge {surge} is too small for {replicas} replicas: no sequence of updates from weight "
                        f"{0 if current is None else current} to {target} keeps every update within "
                        f"{replicas} + {surge} replicas; raise surge to {enough}")
    return path[0]


def schedule(replicas: int, steps: tuple[int, ...] | list[int] = DEFAULT_STEPS, surge: int = 1) -> list[int]:
    """Every weight a rollout passes through, from the first update to 100 (the operator's steps, split where a
    step would exceed replicas + surge)."""
    out: list[int] = []
    current: int | None = None
    while current != 100:
        current = next_weight(replicas, current, steps, surge)
        out.append(current)
    return out


# -- GPU cost ------------------------------------------------------------------------------------------------------


def red_black_replica_hours(replicas: int, weights: list[int], hours_per_step: float) -> float:
    """Replica-hours of a red-black rollout that holds each weight of `weights` for `hours_per_step`, then
    finalizes (the old version's Deployment is removed)."""
    return sum(plan_red_black("a", replicas, "c", w).total_replicas * hours_per_step for w in weights)


def versioned_replica_hours(replicas: int, overlap_hours: float) -> float:
    """Replica-hours of a versioned rollout over the same period: both versions run all their replicas until the
    old one is idle and removed."""
    return 2 * replicas * overlap_hours
