"""The rollout scenarios of `make rehearse` (docs/rehearsal.md, "Rollouts"), each under continuous load
through the gateway:

- red-black of the LLM from its active version to a new one, to completion;
- red-black to a candidate that crashes on start: the update fails (its pods never get Ready), the rollout rolls
  the stack back, and the old version serves all traffic again;
- red-black to a candidate that serves errors (ready, but every request fails): the Gateway retries its failures on
  the old pods, the gate sees them and the rollout rolls the stack back;
- versioned: a new (id, version) whose I/O contract changes (the ranker's extra output) is served beside the old
  one, each on its own hostname; old-format requests keep succeeding on the old version while new-format requests
  (asking for the new output) succeed on the new one; once the old version's consumers have moved (its load stops)
  and it has served nothing for the idle window, `rollout advance` removes it, never the newest.

Each scenario runs the real `llm-serving rollout` (in .venv-infra) with `--runner rehearsal`: every update is
rendered by the program under the mock runtime and carried out here, step by step, by cluster.RehearsalCluster over
its control socket; the gate reads the rehearsal's real Prometheus. The stack files the rollout edits are a copy
(`<workdir>/stacks`). Each scenario ends with one line of a fixed form (docs/rehearsal.md), and the samples (route
weights, Ready pods per version, request outcomes, once a second) go to the report (report.py).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from llm_serving.repository import REPO_ROOT
from rehearsal import render, secrets, storage
from rehearsal.cluster import NAME_LABEL, VERSION_LABEL, RehearsalCluster
from rehearsal.load import LoadResult, run_kserve_load, run_load

INFRA_CLI = REPO_ROOT / ".venv-infra" / "bin" / "llm-serving"
STEPS = "50,100"
SURGE = 1
GATE_WINDOW = "1m"
BAKE_S = 20  # after each update, before the gate reads Prometheus: a few scrapes of the candidate under load
IDLE_WINDOW_S = 30  # versioned: a version with no request in this window is idle (production's default is 7d)


@dataclass
class Sample:
    at: float
    weights: dict[str, int]  # version -> route weight (the HTTPRoute's)
    ready: dict[str, int]  # version -> Ready pods
    requests: int
    failed: int


@dataclass
class ScenarioResult:
    name: str
    line: str
    ok: bool
    requests: int
    failed: int
    peak_pods: int
    bound: int
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    reports: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Context:
    stack: str
    workdir: Path
    cluster: RehearsalCluster
    control: Path
    prometheus_url: str
    gateway_port: int
    domain: str
    verify: Any  # the httpx verify context trusting the rehearsal's CA
    console: Console
    publish: Any  # (model dict, version, storage.DEFECTS key | None) -> {"package": uri, "ioFingerprint": fp}

    @property
    def config_dir(self) -> Path:
        return self.workdir / "stacks"

    def copy_stacks(self) -> None:
        if self.config_dir.exists():
            shutil.rmtree(self.config_dir)
        shutil.copytree(REPO_ROOT / "stacks", self.config_dir)


async def rollout(ctx: Context, action: str, model_id: str, *extra: str) -> dict[str, Any]:
    """One `llm-serving rollout` command against the rehearsal; its JSON report."""
    argv = [str(INFRA_CLI), "rollout", action, model_id, "--stacks", ctx.stack, "--runner", "rehearsal",
            "--control", str(ctx.control), "--config-dir", str(ctx.config_dir),
            "--state-dir", str(ctx.workdir / "rollout-state"), "--prometheus", f"{ctx.stack}={ctx.prometheus_url}",
            "--steps", STEPS, "--surge", str(SURGE), "--window", GATE_WINDOW, "--bake", str(BAKE_S),
            "--idle-window", f"{IDLE_WINDOW_S}s", "--json", *extra]
    ctx.console.print(f"[cyan]$[/] llm-serving rollout {action} {model_id} {' '.join(extra)}", highlight=False)
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=sys.stderr,
                                                cwd=REPO_ROOT)
    out, _ = await proc.communicate()
    text = out.decode()
    start = text.find("{")
    if start < 0:
        raise RuntimeError(f"llm-serving rollout {action} {model_id} exited {proc.returncode} without a report")
    return json.loads(text[start:])


def _versions_view(ctx: Context, model_id: str) -> tuple[dict[str, int], dict[str, int]]:
    """The HTTPRoute's weight and the Ready pods of each version of `model_id`, from the live objects."""
    services = {}  # the Services' Kubernetes names (what backendRefs name) -> version
    for (type_, _name), inputs in ctx.cluster.objects.items():
        metadata = inputs.get("metadata") or {}
        labels = metadata.get("labels") or {}
        if type_ == render.SERVICE and labels.get(NAME_LABEL) == model_id and VERSION_LABEL in labels:
            services[metadata.get("name")] = labels[VERSION_LABEL]
    weights: dict[str, int] = {}
    for (type_, _name), inputs in ctx.cluster.objects.items():
        if type_ != "kubernetes:gateway.networking.k8s.io/v1:HTTPRoute":
            continue
        for rule in (inputs.get("spec") or {}).get("rules") or []:
            for ref in rule.get("backendRefs") or []:
                if ref.get("name") in services:
                    version = services[ref["name"]]
                    weights[version] = max(weights.get(version, 0), int(ref.get("weight", 1)))
    ready: dict[str, int] = {}
    for runner in ctx.cluster.runners:
        if runner.plan.labels.get(NAME_LABEL) == model_id and runner.status.ready:
            version = runner.plan.labels.get(VERSION_LABEL, "?")
            ready[version] = ready.get(version, 0) + 1
    return weights, ready


async def _under_load(ctx: Context, model_id: str, body, start_load=None) -> tuple[LoadResult, list[Sample], Any]:
    """Run `body()` with the load on and a sample every second (and a live line every five). The load is OpenAI
    completions on the model's hostname, or what `start_load(host, stop, result)` returns (a coroutine)."""
    stop = asyncio.Event()
    load = LoadResult()
    samples: list[Sample] = []
    host = f"{model_id}.{ctx.domain}"
    load_task = asyncio.create_task(start_load(host, stop, load) if start_load is not None else
                                    run_load(ctx.gateway_port, host, model_id, ctx.verify, stop, load))

    async def sampler() -> None:
        tick = 0
        while not stop.is_set():
            weights, ready = _versions_view(ctx, model_id)
            samples.append(Sample(time.monotonic() - load.started, weights, ready, load.requests, load.failed))
            if tick % 5 == 0:
                ctx.console.print(f"  [dim]{samples[-1].at:6.0f}s[/] weights {weights or '-'}  ready {ready or '-'}  "
                                  f"requests {load.requests}, failed {load.failed}", highlight=False)
            tick += 1
            await asyncio.sleep(1)

    sample_task = asyncio.create_task(sampler())
    try:
        await asyncio.sleep(5)  # traffic on the active version before anything changes
        outcome = await body()
        await asyncio.sleep(5)  # and after the last change
    finally:
        stop.set()
        await asyncio.gather(load_task, sample_task, return_exceptions=True)
    return load, samples, outcome


def _model_config(ctx: Context, model_id: str) -> dict[str, Any]:
    import yaml

    doc = yaml.safe_load((ctx.config_dir / f"Pulumi.{ctx.stack}.yaml").read_text())
    for model in doc["config"]["llm-serving:models"]:
        if model["id"] == model_id:
            return model
    raise RuntimeError(f"{ctx.stack}: no model {model_id}")


def weights_gib_args(model: dict[str, Any]) -> list[str]:
    """`--weights-gib` for a new version of `model`: what the stack declares for its active version (the rehearsal's
    candidates are packaged from the same demo model as the version they replace, so they are declared the same
    size). The schema requires it of an LLM's versions; a model that declares none gets none. An LLM whose active
    version declares no size is an error: the rehearsal does not make a number up."""
    active = str(model.get("active") or model["versions"][-1]["version"])
    entry = next((v for v in model.get("versions") or [] if str(v["version"]) == active), None)
    declared = None if entry is None else entry.get("weightsGib")
    if declared is not None:
        return ["--weights-gib", f"{float(declared):g}"]
    if model.get("kind", "vllm") == "vllm":
        raise RuntimeError(f"{model['id']}: its active version {active} declares no weightsGib in the stack, so the "
                           f"rehearsal has no size to declare for the new version (the schema requires one of a "
                           f"vllm model)")
    return []


async def _start(ctx: Context, model_id: str, version: str, entry: dict[str, str]) -> dict[str, Any]:
    """`llm-serving rollout start` of a published version (its package URI and I/O fingerprint, and the weights' size
    the stack declares for the model's active version)."""
    return await rollout(ctx, "start", model_id, "--version", version, "--package", entry["package"],
                         "--io-fingerprint", entry["ioFingerprint"], *weights_gib_args(_model_config(ctx, model_id)))


async def red_black(ctx: Context, model_id: str, to_version: str) -> ScenarioResult:
    model = _model_config(ctx, model_id)
    from_version = str(model["active"])
    entry = ctx.publish(model, to_version, None)
    ctx.cluster.pods.reset_peaks()
    reports: list[dict[str, Any]] = []

    async def body() -> str:
        report = await _start(ctx, model_id, to_version, entry)
        reports.append(report)
        for _ in range(len(STEPS.split(",")) + 1):
            status = report["stacks"][0]["status"]
            if status == "finalized" or not report["ok"]:
                return status
            report = await rollout(ctx, "advance", model_id)
            reports.append(report)
        return report["stacks"][0]["status"]

    load, samples, status = await _under_load(ctx, model_id, body)
    done = status == "finalized"
    bound = int(model["replicas"]) + SURGE
    peak = ctx.cluster.pods.peak.get(model_id, 0)
    line = (f"red-black {model_id} {from_version} -> {to_version}: {'done' if done else status}; "
            f"{load.requests} requests, {load.failed} failed")
    return ScenarioResult("red-black", line, done and load.failed == 0 and peak <= bound, load.requests, load.failed,
                          peak, bound, samples, load.failures(), reports)


async def rollback(ctx: Context, model_id: str, bad_version: str) -> ScenarioResult:
    """A candidate whose engine cannot start (its model.json asks for a context the model does not have): its pods
    crash-loop, the update fails, the rollout rolls the stack back."""
    model = _model_config(ctx, model_id)
    from_version = str(model["active"])
    entry = ctx.publish(model, bad_version, "crash-on-start")
    ctx.cluster.pods.reset_peaks()
    reports: list[dict[str, Any]] = []

    async def body() -> str:
        report = await _start(ctx, model_id, bad_version, entry)
        reports.append(report)
        return report["stacks"][0]["status"]

    load, samples, status = await _under_load(ctx, model_id, body)
    weights, ready = _versions_view(ctx, model_id)
    back = status == "rolled back" and weights == {from_version: 100} and set(ready) == {from_version}
    bound = int(model["replicas"]) + SURGE
    peak = ctx.cluster.pods.peak.get(model_id, 0)
    line = (f"rollback {model_id} {from_version} -> {bad_version}: {'rolled back' if back else status}; "
            f"{load.requests} requests, {load.failed} failed")
    return ScenarioResult("rollback", line, back and load.failed == 0 and peak <= bound, load.requests, load.failed,
                          peak, bound, samples, load.failures(), reports)


async def rollback_errors(ctx: Context, model_id: str, bad_version: str) -> ScenarioResult:
    """A candidate that starts, passes its probes and fails every request (storage.DEFECTS "serves-errors"): it
    takes its share of traffic at the first step, the Gateway retries each of its failures on an old pod (the
    BackendTrafficPolicy, pod_contract.py), the gate reads the candidate's failures from Prometheus (Triton counts
    every failed attempt) and the rollout rolls the stack back. Under KServe load (the model's own I/O) through the
    gateway."""
    model = _model_config(ctx, model_id)
    from_version = str(model["active"])
    entry = ctx.publish(model, bad_version, "serves-errors")
    ctx.cluster.pods.reset_peaks()
    meta = await _metadata(ctx, f"{model_id}.{ctx.domain}", model_id)
    outputs = [t["name"] for t in meta["outputs"]]

    def kserve_load(host: str, stop: asyncio.Event, result: LoadResult):
        return run_kserve_load(ctx.gateway_port, host, model_id, _infer_body(meta), outputs, ctx.verify, stop, result,
                               pause_s=0.5)

    load, samples, report = await _under_load(ctx, model_id, lambda: _start(ctx, model_id, bad_version, entry),
                                              kserve_load)
    reports = [report]
    stack = report["stacks"][0]
    gate = stack.get("gate") or {}
    weights, ready = _versions_view(ctx, model_id)
    served = any(s.weights.get(bad_version, 0) > 0 for s in samples)  # the candidate did take traffic
    back = (stack["status"] == "rolled back" and weights == {from_version: 100} and set(ready) == {from_version}
            and served and gate.get("passed") is False and "error ratio" in (gate.get("reason") or ""))
    outcome = "rolled back" if back else (f"{stack['status']} (candidate weighted: {served}, gate: "
                                          f"{gate.get('reason') or gate.get('passed')})")
    bound = int(model["replicas"]) + SURGE
    peak = ctx.cluster.pods.peak.get(model_id, 0)
    line = (f"rollback {model_id} {from_version} -> {bad_version}: {outcome}; {load.requests} requests, "
            f"{load.failed} failed")
    return ScenarioResult("rollback-errors", line, back and load.failed == 0 and peak <= bound, load.requests,
                          load.failed, peak, bound, samples, load.failures(), reports)


def _version_host(ctx: Context, model_id: str, version: str) -> str | None:
    """The HTTP hostname of one version's route (a versioned model), from the live HTTPRoutes."""
    for (type_, _name), inputs in ctx.cluster.objects.items():
        labels = (inputs.get("metadata") or {}).get("labels") or {}
        if (type_ == "kubernetes:gateway.networking.k8s.io/v1:HTTPRoute" and labels.get(NAME_LABEL) == model_id
                and labels.get(VERSION_LABEL) == version):
            return ((inputs.get("spec") or {}).get("hostnames") or [None])[0]
    return None


async def _metadata(ctx: Context, host: str, model_id: str) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(verify=ctx.verify, timeout=30, headers=secrets.auth_headers()) as client:
        response = await client.get(f"https://127.0.0.1:{ctx.gateway_port}/v2/models/{model_id}",
                                    headers={"Host": host}, extensions={"sni_hostname": host})
    response.raise_for_status()
    return response.json()


def _infer_body(metadata: dict[str, Any], outputs: list[str] | None = None) -> dict[str, Any]:
    from rehearsal.traffic import example_inputs

    arrays = example_inputs(metadata)
    body: dict[str, Any] = {"inputs": [{"name": t["name"], "shape": list(arrays[t["name"]].shape),
                                        "datatype": t["datatype"], "data": arrays[t["name"]].ravel().tolist()}
                                       for t in metadata["inputs"]]}
    if outputs:
        body["outputs"] = [{"name": name} for name in outputs]
    return body


async def versioned(ctx: Context, model_id: str, new_version: str) -> ScenarioResult:
    model = _model_config(ctx, model_id)
    old_version = str(model["versions"][-1]["version"])
    entry = ctx.publish(model, new_version, None)
    ctx.cluster.pods.reset_peaks()
    old_host = _version_host(ctx, model_id, old_version)
    if old_host is None:
        raise RuntimeError(f"{model_id} {old_version}: no route of its own (is {model_id} versioned?)")
    old_meta = await _metadata(ctx, old_host, model_id)
    old_outputs = [t["name"] for t in old_meta["outputs"]]
    old_load, new_load = LoadResult(), LoadResult()
    stop_old, stop_new, stop_samples = asyncio.Event(), asyncio.Event(), asyncio.Event()
    samples: list[Sample] = []
    reports: list[dict[str, Any]] = []
    tasks = [asyncio.create_task(run_kserve_load(ctx.gateway_port, old_host, model_id, _infer_body(old_meta),
                                                 old_outputs, ctx.verify, stop_old, old_load))]

    async def sampler() -> None:
        started = time.monotonic()
        while not stop_samples.is_set():
            _, ready = _versions_view(ctx, model_id)
            weights = {v: 100 for v in ready}  # each version owns its hostname: all of that hostname's traffic
            requests, failed = old_load.requests + new_load.requests, old_load.failed + new_load.failed
            samples.append(Sample(time.monotonic() - started, weights, ready, requests, failed))
            if len(samples) % 5 == 1:
                ctx.console.print(f"  [dim]{samples[-1].at:6.0f}s[/] ready {ready or '-'}  old-format requests "
                                  f"{old_load.requests} ({old_load.failed} failed), new-format {new_load.requests} "
                                  f"({new_load.failed} failed)", highlight=False)
            await asyncio.sleep(1)

    tasks.append(asyncio.create_task(sampler()))
    outcome = "not started"
    try:
        await asyncio.sleep(5)
        report = await _start(ctx, model_id, new_version, entry)
        reports.append(report)
        new_host = _version_host(ctx, model_id, new_version)
        if not report["ok"] or new_host is None:
            outcome = report["stacks"][0]["status"]
        else:
            new_meta = await _metadata(ctx, new_host, model_id)
            added = [t["name"] for t in new_meta["outputs"] if t["name"] not in old_outputs]
            tasks.append(asyncio.create_task(run_kserve_load(ctx.gateway_port, new_host, model_id,
                                                             _infer_body(new_meta, old_outputs + added),
                                                             old_outputs + added, ctx.verify, stop_new, new_load)))
            await asyncio.sleep(20)  # both versions served at once
            busy = await rollout(ctx, "advance", model_id)  # the old version still has consumers: kept
            reports.append(busy)
            stop_old.set()  # its consumers moved to the new version
            await asyncio.sleep(IDLE_WINDOW_S + 30)  # past the idle window, with a scrape or two to spare
            idle = await rollout(ctx, "advance", model_id)
            reports.append(idle)
            await asyncio.sleep(5)
            kept = _version_host(ctx, model_id, new_version) is not None
            removed = _version_host(ctx, model_id, old_version) is None
            both = (added and busy["stacks"][0]["status"] != "removed idle" and idle["stacks"][0]["status"]
                    == "removed idle" and kept and removed and old_load.requests > 0 and new_load.requests > 0)
            outcome = "both served" if both else (f"new outputs {added}, then {busy['stacks'][0]['status']}, "
                                                  f"{idle['stacks'][0]['status']}")
    finally:
        stop_old.set()
        stop_new.set()
        stop_samples.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    requests, failed = old_load.requests + new_load.requests, old_load.failed + new_load.failed
    line = (f"versioned {model_id} {old_version} + {new_version}: {outcome}; {requests} requests, "
            f"{failed} failed")
    bound = 2 * int(model["replicas"])  # each version its replicas while both are served (no surge: no swap)
    peak = ctx.cluster.pods.peak.get(model_id, 0)
    return ScenarioResult("versioned", line, outcome == "both served" and failed == 0 and peak <= bound, requests,
                          failed, peak, bound, samples, old_load.failures(5) + new_load.failures(5), reports)


# -- which of them a stack runs ----------------------------------------------------------------------------------


class ScenarioError(RuntimeError):
    """A scenario was asked for that the stack cannot run (it lacks the model the scenario rolls out)."""


def _next_minor(version: str, step: int) -> str:
    major, minor, *_ = version.split(".")
    return f"{major}.{int(minor) + step}.0"


def runnable(ctx: Context, models: list[dict[str, Any]],
             only: tuple[str, ...] = ()) -> list[tuple[str, Callable[[], Awaitable[ScenarioResult]]]]:
    """The scenarios the stack's `models` allow, in options.SCENARIOS' order, each ready to run (`only`: those
    alone; one the stack cannot run is a ScenarioError). What a missing model rules out is printed, so a run that
    skips a scenario says why."""

    def red_black_of(kind: str) -> dict[str, Any] | None:
        return next((m for m in models if m.get("strategy") == "red-black" and m["kind"] == kind), None)

    llm, erroring = red_black_of("vllm"), red_black_of(storage.DEFECTS["serves-errors"])
    versioned_model = next((m for m in models if m.get("strategy") == "versioned"), None)
    runs: list[tuple[str, Callable[[], Awaitable[ScenarioResult]]]] = []
    if llm is None:
        ctx.console.print(f"[yellow]{ctx.stack} has no red-black LLM: no red-black and crash rollback scenarios[/]")
    else:
        good, bad = _next_minor(str(llm["active"]), 1), _next_minor(str(llm["active"]), 2)
        runs += [("red-black", lambda: red_black(ctx, llm["id"], good)),
                 ("rollback", lambda: rollback(ctx, llm["id"], bad))]
    if erroring is None:
        ctx.console.print(f"[yellow]{ctx.stack} has no red-black Python-backend model: no rollback of a candidate "
                          "that serves errors[/]")
    else:
        runs.append(("rollback-errors", lambda: rollback_errors(
            ctx, erroring["id"], _next_minor(str(erroring["active"]), 1))))
    if versioned_model is None:
        ctx.console.print(f"[yellow]{ctx.stack} has no versioned model: no versioned scenario[/]")
    else:
        newest = str(versioned_model["versions"][-1]["version"])
        runs.append(("versioned", lambda: versioned(ctx, versioned_model["id"], _next_minor(newest, 1))))
    if only:
        runs = [(name, run) for name, run in runs if name in only]
        missing = sorted(set(only) - {name for name, _ in runs})
        if missing:
            raise ScenarioError(f"{ctx.stack} cannot run scenario(s) {', '.join(missing)} (see above)")
    return runs
