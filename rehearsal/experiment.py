"""One experiment of the stack through the gateway (docs/rehearsal.md, "An experiment through the
gateway"), as a client service runs it: `llm_serving_client.Client` built from the stack outputs the rehearsal
rendered, its routes dialled at the rehearsal's gateway (`GatewayEndpoints`: the models' hostnames kept for TLS and
routing), `chat(experiment=..., unit=...)` for a fixed set of users, so the client assigns the arms and sends each
call's `x-llm-serving-experiment` header. The pods count what they served per arm
(`llm_serving_experiment_requests_total`, serving_image/request_context.py); the rehearsal's Prometheus, scraping
them through the PodMonitor, is asked for those counts, and each arm's is set beside the client's own
(`client.experiment_stats`). An arm with nothing counted on Prometheus, or counted otherwise than the client sent it,
is a problem naming the experiment and the arm: the rehearsal fails on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from llm_serving.stack_outputs import ExperimentOutputs, StackOutputs
from llm_serving_client import CallError, Client, assign
from llm_serving_client.experiments import ArmStats

UNITS = 40  # users: at 50/50 each arm gets some of them (the assignment is a pure function: the same ones every run)
CALLS_PER_UNIT = 2
MAX_TOKENS = 4
WORKERS = 2  # concurrent calls: a bounded load, as load.py's (the pods' engines share this machine's cores)
PROMPT = "The platform serves"
METRIC = "llm_serving_experiment_requests_total"
# How long the counts may take to reach Prometheus after the last call: the PodMonitor scrapes every 15 s
# (infra/observability.py SCRAPE_INTERVAL); four intervals leave room for a slow scrape on a busy machine.
SCRAPE_WAIT_S = 60.0


class ExperimentCheckError(ValueError):
    pass


@dataclass(frozen=True)
class ArmCount:
    arm: str
    percent: float
    units: int  # the fixed units the client assigned to this arm
    client_calls: int  # client.experiment_stats: the calls it made on this arm
    client_errors: int
    prometheus: int | None  # the pods' count on Prometheus, every status; None: no series for the arm


@dataclass(frozen=True)
class ExperimentCheck:
    experiment: str
    unit: str  # what the assignment hashes (the stack's `unit`)
    arms: tuple[ArmCount, ...]
    problems: tuple[str, ...]  # each names the experiment and the arm; none: every arm counted as the client sent it

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def calls(self) -> int:
        return sum(a.client_calls for a in self.arms)

    def lines(self) -> list[str]:
        out = [f"experiment {self.experiment} (unit {self.unit}, {sum(a.units for a in self.arms)} {self.unit}s, "
               f"through the gateway):"]
        for a in self.arms:
            counted = "no series" if a.prometheus is None else str(a.prometheus)
            out.append(f"  arm {a.arm} {a.percent:g}%: {a.units} {self.unit}s, client {a.client_calls} calls "
                       f"({a.client_errors} errors), Prometheus {counted}")
        out += [f"  {p}" for p in self.problems]
        verdict = ("every arm counted on Prometheus as the client sent it" if self.ok
                   else f"{len(self.problems)} problem(s)")
        out.append(f"experiment {self.experiment}: {verdict}")
        return out


def choose(outputs: StackOutputs) -> tuple[str, ExperimentOutputs] | None:
    """The stack's first experiment whose arms all call an LLM (what `chat` drives), or None when it has none."""
    for name, experiment in outputs.experiments.items():
        if all(outputs.model(a.model).kind == "vllm" for a in experiment.arms):
            return name, experiment
    return None


def units(count: int = UNITS) -> list[str]:
    return [f"user-{i:03d}" for i in range(count)]


def drive(client: Client, name: str, unit_ids: list[str], calls_per_unit: int = CALLS_PER_UNIT,
          workers: int = WORKERS) -> list[str]:
    """Every unit's calls of experiment `name` (blocking: run it off the event loop); the failed calls, each named
    by its unit and the client's error (which names the model)."""
    def one(unit: str) -> str:
        try:
            client.chat(experiment=name, unit=unit, messages=[{"role": "user", "content": PROMPT}],
                        max_tokens=MAX_TOKENS)
        except CallError as exc:
            return f"experiment {name} {unit}: {exc}"
        return ""

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return [f for f in pool.map(one, [u for _ in range(calls_per_unit) for u in unit_ids]) if f]


def query(name: str) -> str:
    """Each arm's requests of experiment `name` as the pods counted them, every protocol and status together."""
    return f'sum by (arm) ({METRIC}{{experiment="{name}"}})'


def counts_from_vector(result: list[Mapping[str, Any]]) -> dict[str, int]:
    """A Prometheus instant vector (`/api/v1/query`'s `result`) of `query` as {arm: count}."""
    counts = {}
    for sample in result:
        arm = (sample.get("metric") or {}).get("arm")
        if arm is None:
            raise ExperimentCheckError(f"a {METRIC} sample without an arm label: {sample}")
        counts[arm] = int(float(sample["value"][1]))
    return counts


def compare(name: str, experiment: ExperimentOutputs, unit_ids: list[str], stats: Mapping[str, ArmStats],
            counted: Mapping[str, int]) -> ExperimentCheck:
    """Each declared arm's units, the client's calls and the pods' count; a problem for every arm the fixed units
    missed, every arm with nothing counted, every count that is not the client's and every arm counted that the
    stack does not declare."""
    assigned = [assign(name, unit, experiment.arms) for unit in unit_ids]
    rows, problems = [], []
    for arm in experiment.arms:
        own = stats.get(arm.name) or ArmStats()
        seen = counted.get(arm.name)
        rows.append(ArmCount(arm.name, arm.percent, assigned.count(arm.name), own.calls, own.errors, seen))
        where = f"experiment {name} arm {arm.name}"
        if arm.percent > 0 and not assigned.count(arm.name):
            problems.append(f"{where}: none of the {len(unit_ids)} {experiment.unit}s is assigned to it")
        if not seen:
            problems.append(f"{where}: no request counted on the rehearsal's Prometheus ({METRIC}); the client sent "
                            f"{own.calls}")
        elif seen != own.calls:
            problems.append(f"{where}: Prometheus counted {seen} requests, the client sent {own.calls}")
    declared = {a.name for a in experiment.arms}
    problems += [f"experiment {name} arm {arm}: counted on Prometheus ({counted[arm]}), but the stack declares "
                 f"no such arm (declared: {sorted(declared)})" for arm in sorted(set(counted) - declared)]
    return ExperimentCheck(name, experiment.unit, tuple(rows), tuple(problems))


async def await_counts(read: Callable[[], dict[str, int]], expected: Mapping[str, int], timeout_s: float,
                       every_s: float = 2.0) -> dict[str, int]:
    """Prometheus' counts once they are the client's (the pods are scraped every interval), or the last ones read
    when `timeout_s` passed first: compare() then names the arms that differ."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = read()
        if all(counts.get(arm) == n for arm, n in expected.items()) or time.monotonic() >= deadline:
            return counts
        await asyncio.sleep(every_s)
