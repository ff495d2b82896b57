"""The experiment assignment hash (docs/clients.md, "Experiments"): weighted rendezvous hashing of (experiment,
arm, unit).

Each arm draws a key for the unit from its own hash, an exponential draw with rate equal to the arm's percent; the
smallest key wins, so an arm wins with probability percent / 100 exactly. The keys of the other arms do not depend
on an arm's percent: changing one arm's share (the others keeping their proportions to each other) moves units only
into or out of that arm, and an arm added later takes units only from the others, never shuffles them. Contiguous
bucket ranges would not do that: changing one range's width shifts every range after it.

A pure function of its inputs, with nothing process-local in it (no Python `hash`, no random state), so every
process, region and restart agrees; another language gets the same arms from the same five lines.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Protocol

DOMAIN = b"llm-serving-experiment\0"


class Weighted(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def percent(self) -> float: ...


def unit_draw(experiment: str, arm: str, unit: str) -> float:
    """A uniform draw in (0, 1) from sha256 of the experiment, the arm and the unit (first 8 bytes, big-endian)."""
    digest = hashlib.sha256(DOMAIN + b"\0".join(s.encode() for s in (experiment, arm, unit))).digest()
    return (int.from_bytes(digest[:8], "big") + 0.5) / 2.0**64


def assign(experiment: str, unit: str, arms: Sequence[Weighted]) -> str:
    """The arm of `unit` in `experiment`: the smallest -ln(u) / percent over the arms with a share (ties, which a
    64-bit draw makes vanishingly rare: the earlier-declared arm)."""
    if not unit:
        raise ValueError(f"experiment {experiment!r}: the unit id is empty; every call in an experiment names its unit")
    best, best_key = None, math.inf
    for arm in arms:
        if arm.percent <= 0:
            continue
        key = -math.log(unit_draw(experiment, arm.name, unit)) / arm.percent
        if key < best_key:
            best, best_key = arm.name, key
    if best is None:
        raise ValueError(f"experiment {experiment!r}: no arm has a share")
    return best
