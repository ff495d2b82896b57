"""A rollout across stacks (docs/architecture.md §4): edit each stack's config file, run its update, check it, in waves.

One command moves every named stack one step: the first wave (one region) first, then the rest, one stack at a
time. After each stack's update an analysis gate reads the candidate's error ratio and latency from that region's
Prometheus. A failed update or a failed gate stops the rollout at that stack and rolls that stack back (one
update: the candidate leaves its config, the active version gets every replica and all traffic back); the stacks
after it are not touched. Stacks that passed earlier in the same command keep their new step: their own gate
passed, and §4 rolls back only the failed region; the summary says so, and `abort` rolls every region back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from infra.config import ConfigError, ModelConfig, StackConfig, active_version, repeated
from infra.rollout.gate import GateResult, GateThresholds, PrometheusClient, analyze, idle_evidence
from infra.rollout.planner import DEFAULT_STEPS, PlanError, next_weight, plan_red_black, rollback_peak
from infra.rollout.replication import ReplicaCheck, missing_replicas
from infra.rollout.runner import StackRunner, UpResult
from infra.rollout.stackfile import StackFile, StackFileError

Status = Literal["started", "advanced", "finalized", "unchanged", "rolled back", "rollback failed", "not reached",
                 "removed idle", "failed"]



def _held(model: ModelConfig, versions: int) -> str:
    """What `versions` versions of a model hold: GPUs for a model with GPUs, pods (on its CPU node group) for one
    without."""
    if model.gpus:
        return f"{versions * model.replicas * model.gpus} GPUs"
    return f"{versions * model.replicas} pods (no GPUs)"

class RolloutError(RuntimeError):
    """The rollout cannot even begin (bad arguments, a stack in the wrong state); nothing was changed."""


@dataclass(frozen=True)
class Options:
    steps: tuple[int, ...] = DEFAULT_STEPS
    surge: int = 1
    thresholds: GateThresholds = GateThresholds()
    bake_s: float = 0.0  # wait this long after an update before the gate reads Prometheus
    idle_window: str = "7d"  # a versioned model's version with no request in this window is idle
    first_wave: int = 1  # stacks in the first wave; the rest follow one by one


@dataclass
class StackReport:
    stack: str
    status: Status
    before: str = ""
    after: str = ""
    detail: str = ""
    gate: GateResult | None = None
    peak_replicas: int | None = None
    gpu_bound: int | None = None
    overlap_gpus: int | None = None  # versioned: GPUs held by versions other than the newest


@dataclass
class Report:
    action: str
    model: str
    stacks: list[StackReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.status not in ("rolled back", "rollback failed", "failed") for s in self.stacks)


def describe(model: ModelConfig) -> str:
    if model.strategy == "versioned":
        return "versioned: " + ", ".join(v.version for v in model.versions)
    if model.candidate is None:
        return f"{model.active} 100%"
    return f"{model.active} {100 - model.weight}% | {model.candidate} {model.weight}%"  # type: ignore[operator]


def waves(stacks: list[str], first: int = 1) -> list[list[str]]:
    if not stacks:
        raise RolloutError("--stacks: name at least one stack")
    if first < 1:
        raise RolloutError(f"--first-wave: at least 1 stack, got {first}")
    dupes = repeated(stacks)
    if dupes:
        raise RolloutError(f"--stacks: {dupes} named twice")
    return [stacks[:first], stacks[first:]] if stacks[first:] else [stacks]


GateFn = Callable[[str, str, str], GateResult]  # (stack, model id, version) -> verdict


def prometheus_gate(clients: dict[str, PrometheusClient], thresholds: GateThresholds,
                    kind_of: Callable[[str, str], str] = lambda stack, model_id: "vllm") -> GateFn:
    """The gate on each stack's Prometheus; `kind_of(stack, model id)` is the model's kind (its latency's source)."""
    def gate(stack: str, model_id: str, version: str) -> GateResult:
        return analyze(clients[stack], model_id, version, thresholds, kind_of(stack, model_id))

    return gate


class Rollout:
    def __init__(self, runner: StackRunner, model_id: str, stacks: list[str], options: Options = Options(),
                 gate: GateFn | None = None, prometheus: dict[str, PrometheusClient] | None = None,
                 on_event: Callable[[str], None] = lambda _: None, replicas: ReplicaCheck | None = None):
        self.runner = runner
        self.model_id = model_id
        self.stacks = list(stacks)
        self.options = options
        self.gate = gate
        self.prometheus = prometheus or {}
        self.on_event = on_event
        # Asked before `start` writes a package into any stack: is it in that stack's region yet?
        self.replicas = replicas
        self.waves = waves(self.stacks, options.first_wave)

    # -- helpers -----------------------------------------------------------------------------------------------

    def _file(self, stack: str) -> StackFile:
        try:
            return StackFile.load(self.runner.config_path(stack))
        except StackFileError as err:
            raise RolloutError(str(err)) from None

    def _model(self, stack: str) -> ModelConfig:
        try:
            return self._file(stack).model(self.model_id)
        except StackFileError as err:
            raise RolloutError(str(err)) from None

    def _typed(self, stack: str) -> StackConfig:
        try:
            return self._file(stack).typed()
        except (StackFileError, ConfigError) as err:
            raise RolloutError(str(err)) from None

    def _up(self, stack: str, what: str) -> UpResult:
        self.on_event(f"{stack}: pulumi up ({what})")
        result = self.runner.up(stack)
        self.on_event(f"{stack}: update {'succeeded' if result.ok else 'FAILED: ' + result.message}")
        return result

    def _rollback(self, stack: str, original_text: str, report: StackReport, why: str) -> None:
        """One update that gives the active version everything back. With a candidate in the file this is always
        the no-candidate shape, never a step back to a lower weight: in the candidate shape the active scales after
        the route moves (right for a forward step), so a lower weight would send traffic to the active before its
        pods exist; without a candidate the route waits for the active's capacity. Otherwise (a failed finalize,
        a versioned start) the file is restored as it was before the step."""
        self.on_event(f"{stack}: rolling back ({why})")
        sf = self._file(stack)
        model = sf.model(self.model_id)
        if model.strategy == "red-black" and model.candidate is not None:
            sf.rollback(self.model_id)
            sf.save()
        else:
            sf.path.write_text(original_text)
        bound = rollback_peak(model.replicas, model.weight) if model.candidate is not None else model.replicas
        result = self._up(stack, "rollback")
        if self.model_id in result.peak_replicas:
            # capacity first: the active is back at all replicas while the candidate still serves
            report.peak_replicas = result.peak_replicas[self.model_id]
            report.gpu_bound = bound
        after = self._model(stack)
        report.after = describe(after)
        if result.ok:
            report.status, report.detail = "rolled back", why
        else:
            report.status = "rollback failed"
            report.detail = f"{why}; the rollback update failed too, act by hand: {result.message}"

    def _run(self, action: str, step: Callable[[str, StackReport, StackFile, ModelConfig], str | None]) -> Report:
        """Apply `step` (which edits the file and returns a gate version, or None for no gate) stack by stack."""
        report = Report(action, self.model_id)
        for stack in self.stacks:  # validate every stack before changing any
            self._model(stack)
        stopped = False
        for w, wave in enumerate(self.waves, start=1):
            for stack in wave:
                if stopped:
                    report.stacks.append(StackReport(stack, "not reached", describe(self._model(stack))))
                    continue
                self.on_event(f"wave {w}: {stack}")
                self.runner.prepare(stack)
                sf = self._file(stack)
                original = sf.path.read_text()
                model = sf.model(self.model_id)
                entry = StackReport(stack, "unchanged", before=describe(model))
                report.stacks.append(entry)
                try:
                    gate_version = step(stack, entry, sf, model)
                    if entry.status != "unchanged":
                        sf.save()  # validated by the program's schema first: an invalid edit is never written
                except (PlanError, StackFileError) as err:
                    entry.status, entry.detail = "failed", str(err)
                    stopped = True
                    continue
                if entry.status == "unchanged":
                    entry.after = entry.before
                    continue
                result = self._up(stack, f"{entry.before} -> {describe(sf.model(self.model_id))}")
                entry.peak_replicas = result.peak_replicas.get(self.model_id)
                if not result.ok:
                    self._rollback(stack, original, entry, f"update failed: {result.message}")
                    stopped = True
                    continue
                entry.after = describe(self._model(stack))
                if gate_version is not None and self.gate is not None:
                    if self.options.bake_s:
                        self.on_event(f"{stack}: baking {self.options.bake_s:g}s before the analysis gate")
                        time.sleep(self.options.bake_s)
                    verdict = self.gate(stack, self.model_id, gate_version)
                    entry.gate = verdict
                    self.on_event(f"{stack}: gate {verdict.describe()}")
                    if not verdict.passed:
                        self._rollback(stack, original, entry, f"analysis gate failed: {verdict.reason}")
                        stopped = True
        return report

    def _bound(self, model: ModelConfig) -> int:
        return model.replicas + self.options.surge

    # -- commands ----------------------------------------------------------------------------------------------

    def start(self, version: dict[str, str]) -> Report:
        """Red-black: `version` becomes the candidate at the first step. Versioned: `version` is served beside the
        others. A stack that already rolls out this version is left as it is."""

        def step(stack: str, entry: StackReport, sf: StackFile, model: ModelConfig) -> str | None:
            if model.strategy == "versioned":
                if any(v.version == version["version"] for v in model.versions):
                    entry.detail = f"already serves {version['version']}"
                    return None
                sf.add_version(self.model_id, version)
                entry.status = "started"
                entry.overlap_gpus = len(model.versions) * model.replicas * model.gpus
                entry.detail = (f"{len(model.versions)} older version(s) keep {_held(model, len(model.versions))} "
                                f"until idle; "
                                f"consumers move by changing their own config")
                return None  # nobody calls a new version yet: its gate is the update itself (ready or failed)
            if model.candidate == version["version"]:
                entry.detail = f"already rolling out {model.candidate} at {model.weight}%: use advance"
                return None
            weight = next_weight(model.replicas, None, self.options.steps, self.options.surge)
            sf.start(self.model_id, version, weight)
            entry.status, entry.gpu_bound = "started", self._bound(model)
            return version["version"]

        if self.replicas is not None:
            configs = {stack: self._typed(stack) for stack in self.stacks}
            missing = missing_replicas(configs, version["package"], self.replicas, version.get("ioFingerprint"),
                                       self.model_id)
            if missing:
                raise RolloutError(f"{version['package']} cannot be rolled out yet (nothing was changed):\n  "
                                   + "\n  ".join(missing))
        return self._run("start", step)

    def advance(self) -> Report:
        """Red-black: every stack's candidate to its next step (at 100: finalize). Versioned: remove idle
        versions (never the newest)."""

        def step(stack: str, entry: StackReport, sf: StackFile, model: ModelConfig) -> str | None:
            if model.strategy == "versioned":
                return self._remove_idle(stack, entry, sf, model)
            if model.candidate is None:
                raise StackFileError(f"stack {stack}: {self.model_id} has no rollout in progress; start one")
            entry.gpu_bound = self._bound(model)
            if model.weight == 100:
                sf.finalize(self.model_id)
                entry.status, entry.detail = "finalized", f"{model.candidate} is now the active version"
                return None
            weight = next_weight(model.replicas, model.weight, self.options.steps, self.options.surge)
            sf.set_weight(self.model_id, weight)
            entry.status = "advanced"
            return model.candidate

        return self._run("advance", step)

    def _remove_idle(self, stack: str, entry: StackReport, sf: StackFile, model: ModelConfig) -> None:
        newest = active_version(model)  # the version the outputs name and the policies protect
        client = self.prometheus.get(stack)
        if client is None:
            raise StackFileError(f"stack {stack}: idle versions are found from Prometheus; no Prometheus for it")
        idle, busy = set(), []
        # A version an experiment's arm calls stays, idle or not (its share may be 0 for now): removing it would
        # leave the experiment pointing at a version the stack no longer serves (docs/clients.md, "Experiments").
        in_experiments = {a.version: e.name for e in sf.typed().experiments for a in e.arms
                          if a.model == self.model_id and a.version}
        for v in model.versions:
            if v.version == newest:
                continue
            if v.version in in_experiments:
                busy.append(f"{v.version} (an arm of experiment {in_experiments[v.version]})")
                continue
            # Removed only when proven idle: scraped for the whole window, its request counter there, nothing
            # served. Missing or partial data keeps the version, and the detail names the series it lacked.
            evidence = idle_evidence(client, self.model_id, v.version, self.options.idle_window)
            (idle.add(v.version) if evidence.idle else busy.append(evidence.describe()))
        older = len(model.versions) - 1
        entry.overlap_gpus = older * model.replicas * model.gpus
        if not idle:
            entry.detail = (f"no version proven idle in {self.options.idle_window}: "
                            f"{', '.join(busy) or 'only the newest'} kept; the overlap holds {_held(model, older)}")
            return None
        sf.remove_versions(self.model_id, idle, newest)
        entry.status = "removed idle"
        entry.detail = (f"removed {sorted(idle)} (no request in {self.options.idle_window}), freeing "
                        f"{_held(model, len(idle))}; "
                        f"kept {newest} (newest){', ' + ', '.join(busy) if busy else ''}")
        return None

    def abort(self) -> Report:
        """Every stack rolls back (no gate, no stopping: each region on its own)."""
        report = Report("abort", self.model_id)
        for stack in self.stacks:
            model = self._model(stack)
            if model.strategy == "versioned":
                raise RolloutError(f"stack {stack}: {self.model_id} is versioned: there is nothing to abort (consumers"
                                   f" choose their version; the newest is never removed, idle ones go with advance)")
        for stack in self.stacks:
            self.runner.prepare(stack)
            sf = self._file(stack)
            model = sf.model(self.model_id)
            entry = StackReport(stack, "unchanged", before=describe(model))
            report.stacks.append(entry)
            if model.candidate is None:
                entry.after, entry.detail = entry.before, "no rollout in progress"
                continue
            entry.gpu_bound = rollback_peak(model.replicas, model.weight)  # type: ignore[arg-type]
            self._rollback(stack, sf.path.read_text(), entry, "abort")
            if entry.status == "rolled back":
                entry.detail = f"{model.candidate} removed; {model.active} has all replicas and traffic"
        return report

    def status(self) -> list[dict]:
        rows = []
        for stack in self.stacks:
            model = self._model(stack)
            row = {"stack": stack, "strategy": model.strategy, "config": describe(model), "replicas": model.replicas}
            if model.strategy == "red-black":
                plan = plan_red_black(model.active, model.replicas, model.candidate, model.weight)  # type: ignore
                row["planned"] = {s.version: {"replicas": s.replicas, "weight": s.weight} for s in plan.shares}
                if model.candidate is None:
                    row["next"] = "start"
                elif model.weight == 100:
                    row["next"] = "finalize"
                else:
                    try:
                        weight = next_weight(model.replicas, model.weight, self.options.steps, self.options.surge)
                        row["next"] = f"weight {weight}"
                    except PlanError as err:
                        row["next"] = f"blocked: {err}"
            else:
                row["overlapGpus"] = (len(model.versions) - 1) * model.replicas * model.gpus
            try:
                deployed = (self.runner.outputs(stack).get("models") or {}).get(self.model_id)
            except Exception as err:  # e.g. no Pulumi CLI for the Automation API: shown, not hidden
                deployed, row["deployedError"] = None, f"{type(err).__name__}: {err}"
            row["deployed"] = ({"routeWeights": deployed.get("routeWeights"), "replicas": deployed.get("replicas")}
                               if deployed else None)
            rows.append(row)
        return rows
