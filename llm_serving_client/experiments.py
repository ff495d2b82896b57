"""Experiments on the caller's side (docs/clients.md, "Experiments"): the arm of a unit, its exposure logged once
per process, the header that carries it to the server, and per-arm counts, errors and latencies."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from llm_serving.stack_outputs import ArmOutputs, ExperimentOutputs
from llm_serving_client.assignment import assign
from llm_serving_client.errors import ExperimentError

exposure_log = logging.getLogger("llm_serving_client.exposures")

HEADER = "x-llm-serving-experiment"  # `<experiment>=<arm>`; the same key as gRPC metadata
# How many (experiment, unit) exposures one process remembers: beyond it the oldest may be logged again. A bounded
# memory for a long-lived service with many users; analyses deduplicate by (experiment, unit) anyway.
EXPOSURES_REMEMBERED = 1_000_000


@dataclass
class ArmStats:
    calls: int = 0
    errors: int = 0
    latencies_s: list[float] = field(default_factory=list)

    def quantile(self, q: float) -> float | None:
        """The q-quantile of the arm's call latencies (nearest rank), None before any call."""
        if not self.latencies_s:
            return None
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


@dataclass(frozen=True)
class Assignment:
    experiment: str
    unit: str
    arm: ArmOutputs

    @property
    def header(self) -> str:
        return f"{self.experiment}={self.arm.name}"


class Experiments:
    def __init__(self, declared: dict[str, ExperimentOutputs]):
        self._declared = declared
        self._exposed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._stats: dict[tuple[str, str], ArmStats] = {}
        self._lock = threading.Lock()

    def assign(self, name: str, unit: str, stack: str, *, expose: bool = True) -> Assignment:
        """The unit's arm; `expose` logs the exposure (once per unit). A caller that may still refuse the call
        passes expose=False and calls `expose` once the call goes ahead: a refused call exposed nobody."""
        experiment = self._declared.get(name)
        if experiment is None:
            raise ExperimentError(f"experiment {name!r} is not declared in stack {stack} (declared: "
                                  f"{sorted(self._declared)})", model="?")
        arm_name = assign(name, unit, experiment.arms)
        arm = next(a for a in experiment.arms if a.name == arm_name)
        assignment = Assignment(name, unit, arm)
        if expose:
            self.expose(assignment)
        return assignment

    def expose(self, assignment: Assignment) -> None:
        self._expose(assignment.experiment, self._declared[assignment.experiment], assignment.unit,
                     assignment.arm.name)

    def _expose(self, name: str, experiment: ExperimentOutputs, unit: str, arm: str) -> None:
        key = (name, unit)
        with self._lock:
            if key in self._exposed:
                self._exposed.move_to_end(key)
                return
            self._exposed[key] = None
            if len(self._exposed) > EXPOSURES_REMEMBERED:
                self._exposed.popitem(last=False)
        exposure_log.info(json.dumps({"event": "exposure", "experiment": name, "unit_kind": experiment.unit,
                                      "unit": unit, "arm": arm}))

    def record(self, assignment: Assignment, latency_s: float, error: bool) -> None:
        with self._lock:
            stats = self._stats.setdefault((assignment.experiment, assignment.arm.name), ArmStats())
            stats.calls += 1
            stats.errors += int(error)
            stats.latencies_s.append(latency_s)

    def stats(self, name: str) -> dict[str, ArmStats]:
        """Per arm of `name`: its calls, errors and latencies so far in this process (every declared arm listed)."""
        experiment = self._declared.get(name)
        if experiment is None:
            raise KeyError(f"experiment {name!r} is not declared (declared: {sorted(self._declared)})")
        with self._lock:
            return {a.name: self._stats.get((name, a.name), ArmStats()) for a in experiment.arms}
