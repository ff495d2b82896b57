"""The rollout scenarios of `make rehearse` (issue 17, docs/rehearsal.md, "Rollouts"), each under continuous load
through the gateway:

- red-black of the LLM from its active version to a new one, to completion;
- red-black to a candidate that crashes on start: the update fails (its pods never get Ready), the rollout rolls
  the stack back, and the old version serves all traffic again.

Each scenario runs the real `llm-serving rollout` (in .venv-infra) with `--runner rehearsal`: every update is
rendered by the program under the mock runtime and carried out here, step by step, by cluster.RehearsalCluster over
its control socket; the gate reads the rehearsal's real Prometheus. The stack files the rollout edits are a copy
(`<workdir>/stacks`). Each scenario ends with one line, exactly as the issue states it, and the samples (route
weights, Ready pods per version, request outcomes, once a second) go to the report (report.py).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from llm_serving_cli.rehearsal import render
from llm_serving_cli.rehearsal.cluster import NAME_LABEL, VERSION_LABEL, RehearsalCluster
from llm_serving_cli.rehearsal.load import LoadResult, run_load
from llm_serving_cli.rehearsal.substitutions import REPO_ROOT

INFRA_CLI = REPO_ROOT / ".venv-infra" / "bin" / "llm-serving"
STEPS = "50,100"
SURGE = 1
GATE_WINDOW = "1m"
BAKE_S = 20  # after each update, before the gate reads Prometheus: a few scrapes of the candidate under load


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
    publish: Any  # (model dict, version, engine_args | None) -> {"package": uri, "ioFingerprint": fp}

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
            "--steps", STEPS, "--surge", str(SURGE), "--window", GATE_WINDOW, "--bake", str(BAKE_S), "--json",
            *extra]
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
    services = {}
    for (type_, name), inputs in ctx.cluster.objects.items():
        labels = (inputs.get("metadata") or {}).get("labels") or {}
        if type_ == render.SERVICE and labels.get(NAME_LABEL) == model_id and VERSION_LABEL in labels:
            services[name] = labels[VERSION_LABEL]
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


async def _under_load(ctx: Context, model_id: str, body) -> tuple[LoadResult, list[Sample], Any]:
    """Run `body()` with the load on and a sample every second (and a live line every five)."""
    stop = asyncio.Event()
    load = LoadResult()
    samples: list[Sample] = []
    host = f"{model_id}.{ctx.domain}"
    load_task = asyncio.create_task(run_load(ctx.gateway_port, host, model_id, ctx.verify, stop, load))

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


async def red_black(ctx: Context, model_id: str, to_version: str) -> ScenarioResult:
    model = _model_config(ctx, model_id)
    from_version = str(model["active"])
    entry = ctx.publish(model, to_version, None)
    ctx.cluster.pods.reset_peaks()
    reports: list[dict[str, Any]] = []

    async def body() -> str:
        report = await rollout(ctx, "start", model_id, "--version", to_version, "--package", entry["package"],
                               "--io-fingerprint", entry["ioFingerprint"])
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
    entry = ctx.publish(model, bad_version, {"max_model_len": 1 << 20})
    ctx.cluster.pods.reset_peaks()
    reports: list[dict[str, Any]] = []

    async def body() -> str:
        report = await rollout(ctx, "start", model_id, "--version", bad_version, "--package", entry["package"],
                               "--io-fingerprint", entry["ioFingerprint"])
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
