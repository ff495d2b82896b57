"""`make rehearse [STACK=<stack>]`: a stack's model pods on this machine, exactly as their rendered Deployments say
(docs/architecture.md §3.10b, §5; docs/rehearsal.md).

    render  the program under the mock runtime (.venv-infra)       -> Deployments, Services, monitoring objects
    store   moto's S3; the stack's (model, version)s packaged from the demo model and `llm-serving publish`ed
    FSx     the data repository association as a directory        -> the model-cache volume
    pods    per replica: its own network namespace, a private mount namespace with the pod's volumes, its user,
            a read-only root, the image's ENTRYPOINT with the rendered env over the image's ENV
    kubelet probes as declared, restarts with back-off, termination (preStop, SIGTERM, grace, SIGKILL)
    Services a proxy per Service over its Ready pods; traffic to every model through it
    metrics  Prometheus scraping through the PodMonitor's relabeling, the PrometheusRule loaded, KEDA's query
             and the replicas KEDA and the HPA would set from it (autoscaler.py)

Ends with `rehearsal: <P> pods ready, <R> requests, <F> failed` and the three access lines; exits 1 naming the pod
and the cause when a pod never gets Ready, a request fails or an access case does not hold. Everything it started
is stopped and removed, also on Ctrl-C.

This module is the order of those steps and the run's report; each step's work is elsewhere: the store and
publishing in stack_packages.py, the pods' plans, mounts and launch in node.py, the gateway in gateway.py, which
rollout scenarios a stack runs in scenarios.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from image_build.build import built_ref
from llm_serving.ports import free_port  # below the ephemeral range: see its docstring
from llm_serving.repository import REPO_ROOT
from llm_serving.stack_outputs import StackOutputsError, parse_stack_outputs
from llm_serving_client import Client, GatewayEndpoints
from rehearsal import (
    container,
    experiment,
    model_cache,
    observe,
    options,
    podspec,
    render,
    scenarios,
    secrets,
    storage,
    substitutions,
    traffic,
)
from rehearsal import report as rehearsal_report
from rehearsal.autoscaler import Autoscaler
from rehearsal.gateway import RehearsalGateway, create_gateway
from rehearsal.net import GATEWAY, Network, service_address
from rehearsal.node import Node
from rehearsal.services import Endpoint, ServiceProxy
from rehearsal.stack_packages import StackPackages, publish_stack

CRASH_LOOP_RESTARTS = 3  # a pod restarted this often without getting Ready fails the rehearsal


class RehearsalError(RuntimeError):
    pass


class Rehearsal:
    def __init__(self, stack: str, console: Console, workdir: Path | None = None):
        self.stack = stack
        self.console = console
        self.workdir = workdir or REPO_ROOT / ".cache" / "rehearsal" / stack
        self.net = Network(f"rh{os.getpid() % 100000}")
        self.store: storage.S3Server | None = None  # held from its start: cleanup stops it whatever failed after
        self.models: StackPackages | None = None
        self.prometheus: observe.Prometheus | None = None
        self.image = built_ref()  # the image `make image` built: every pod, the batch worker and the warmer run it
        self.node = Node(self.workdir, self.image, self.net)
        self.proxies: list[tuple[ServiceProxy, dict[str, Any]]] = []
        self.result = traffic.TrafficResult()
        self.notes: list[str] = []
        self.with_scenarios = True
        self.only_scenarios: tuple[str, ...] = ()  # empty: every scenario the stack allows
        self.gateway: RehearsalGateway | None = None  # held before it starts: cleanup stops a half-started one
        self.experiment: experiment.ExperimentCheck | None = None
        self.outside_image: list[str] = []  # pods whose processes were found outside the image's root

    # -- setup -------------------------------------------------------------------------------------------------

    def prepare(self) -> render.Rendered:
        if os.geteuid() != 0:
            raise RehearsalError("the rehearsal needs root (network and mount namespaces, bind mounts)")
        for tool in ("ip", "podman", "runc", "prometheus"):
            if shutil.which(tool) is None:
                raise RehearsalError(f"{tool} is not installed (podman, runc: `make image` installs them; "
                                     "prometheus: make serving-env)")
        if self.workdir.exists():
            shutil.rmtree(self.workdir)
        self.workdir.mkdir(parents=True)
        self.workdir.chmod(0o755)
        self.console.print("[bold]substitutions[/] (what the image holds and this machine does not):")
        self.console.print(f"[bold]image[/] {self.image}: every pod's container runs it (podman, runc)")
        for sub in substitutions.substitutions():
            self.console.print(f"  - {sub.what}\n      -> {sub.here}")
        with self.console.status(f"rendering {self.stack} under the mock runtime"):
            rendered = render.render(self.stack)
        self.console.print(f"rendered {self.stack}: {len(rendered.resources)} resources, "
                           f"{len(rendered.model_deployments())} model Deployment(s), "
                           f"{len(rendered.pod_deployments()) - len(rendered.model_deployments())} other Deployment(s) "
                           "whose pods run here (batch workers)")
        return rendered

    def setup_storage(self, rendered: render.Rendered) -> Path:
        # On the node's bridge, not loopback: the pods (the batch worker) reach S3 from their own namespaces.
        self.store = storage.start_s3_server(str(GATEWAY))
        self.models = publish_stack(self.store, rendered, self.workdir, self.console)
        self._model_cache(rendered, self.models.fsx)
        return self.models.fsx

    def _model_cache(self, rendered: render.Rendered, fsx: Path) -> None:
        """A pod's startup step 1 on a cold and then a warm model cache, around the stack's cache warmer
        (model_cache.py); the pods start after it, on a warm cache."""
        from llm_serving.pod_contract import parse_package_uri

        llm = next((m for m in rendered.models if m.get("kind", "vllm") == "vllm"), rendered.models[0])
        _, model_id, version = parse_package_uri(llm["versions"][0]["package"], rendered.model_prefix)
        with self.console.status("model cache: a pod's step 1 on it cold, the stack's cache warmer, step 1 warm"):
            result = model_cache.rehearse_model_cache(rendered, fsx, self.store,
                                                      model_cache.warmer_in_image(self.image),
                                                      self.workdir / "model-cache", model_id, version)
        for line in result.lines():
            self.console.print(line, markup=False, highlight=False)

    def plans(self, rendered: render.Rendered, fsx: Path) -> list[podspec.PodPlan]:
        self.node.install(rendered, fsx, self.store.endpoint)
        plans = []
        for dep in rendered.pod_deployments():  # the batch workers too: every stack update waits for them
            plans += self.node.plans_for(dep)
        node_groups = [{"name": g["inputs"].get("nodeGroupName") or g["name"], **g["inputs"]}
                       for g in rendered.of_type(render.NODE_GROUP)]
        for g in node_groups:  # the provider's taint effect spelling, as the kubelet sees it
            g["taints"] = [{**t, "effect": "NoSchedule"} for t in g.get("taints") or []]
        for plan in plans:
            self.console.print(podspec.placement_report(plan, node_groups))
        return plans

    # -- the run -----------------------------------------------------------------------------------------------

    def table(self) -> Table:
        table = Table(title=f"rehearsal of {self.stack}")
        for column in ("pod", "address", "phase", "ready after s", "restarts", "last event"):
            table.add_column(column)
        for runner in self.node.runners:
            s = runner.status
            table.add_row(s.name, s.address, s.phase, f"{s.ready_after_s:.1f}" if s.ready_after_s else "-",
                          str(s.restarts), (s.events[-1].split("s ", 1)[-1] if s.events else "")[:70])
        return table

    def _endpoints(self, service: dict[str, Any]):
        selector = service["inputs"]["spec"].get("selector") or {}
        namespace = service["inputs"]["metadata"].get("namespace")

        def ready() -> list[Endpoint]:
            return [Endpoint(r.plan.name, r.status.address, r.plan.ports) for r in self.node.runners
                    if r.status.ready and r.plan.namespace == namespace and render.selects(selector, r.plan.labels)]

        return ready

    def _write_targets(self, path: Path) -> None:
        groups = []
        for r in self.node.runners:
            if r.status.phase not in ("Pending", "Terminated"):
                groups += observe.pod_targets(r.plan.name, r.plan.namespace, r.status.address, r.plan.labels,
                                              r.plan.ports, r.status.ready)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(path)

    async def run_async(self, rendered: render.Rendered, plans: list[podspec.PodPlan]) -> int:
        (self.workdir / "logs").mkdir(exist_ok=True)
        runners = [self.node.add_pod(plan) for plan in plans]
        for j, service in enumerate(rendered.model_services()):
            address = service_address(j)
            self.net.add_service_address(address)
            proxy = ServiceProxy(service["inputs"]["metadata"]["name"], address, service["inputs"]["spec"]["ports"],
                                 self._endpoints(service))
            await proxy.start()
            self.proxies.append((proxy, service))
        prom_dir = self.workdir / "prometheus"
        targets = prom_dir / "targets.json"
        prom_dir.mkdir()
        targets.write_text("[]")
        jobs = [job for pm in rendered.of_type(render.POD_MONITOR) for job in observe.scrape_config(pm["inputs"],
                                                                                                   targets)]
        self.prometheus = observe.Prometheus(prom_dir, free_port())
        self.prometheus.write_config(jobs, observe.rule_file([r["inputs"] for r in
                                                              rendered.of_type(render.PROMETHEUS_RULE)]))
        self.prometheus.start()
        self.console.print(f"Prometheus {self.prometheus.url}: {len(jobs)} scrape job(s) from the PodMonitor")

        for runner in runners:
            self.node.start_pod(runner)
        budget = max(podspec.startup_budget_s(p.probes.get("startup")) for p in plans) + 60
        deadline = time.monotonic() + budget
        with Live(self.table(), console=self.console, refresh_per_second=2, transient=False) as live:
            while time.monotonic() < deadline:
                self._write_targets(targets)
                live.update(self.table())
                if all(r.status.ready for r in self.node.runners):
                    break
                looping = [r for r in self.node.runners if r.status.restarts >= CRASH_LOOP_RESTARTS]
                if looping:
                    break
                await asyncio.sleep(0.5)
            live.update(self.table())
        if not self.console.is_terminal:
            self.console.print()
        not_ready = [r for r in self.node.runners if not r.status.ready]
        for runner in not_ready:
            s = runner.status
            runner._read_logs()
            cause = s.last_cause or f"not Ready within {budget:.0f}s (phase {s.phase})"
            self.console.print(f"[red]pod {s.name} never got Ready[/]: {cause}; last log lines:")
            for line in list(s.logs)[-15:]:
                self.console.print(f"    {line}", markup=False, highlight=False)
        if not not_ready:
            self._check_pods_in_image()
            await self._traffic(rendered)
            await self._observe(rendered, targets)
            if self.result.failed == 0:
                await self._experiment(rendered, targets)
        ready = sum(r.status.ready for r in self.node.runners)
        for failure in self.result.failures[:10]:
            self.console.print(f"[red]request failed[/] {failure}", markup=True)
        results: list[scenarios.ScenarioResult] = []
        if self.with_scenarios and not not_ready and self.result.failed == 0:
            results = await self._scenarios(rendered, targets)
        await self.stop_pods()
        if self.gateway is not None:
            self.gateway.stop()
        for task in self.node.tasks:
            task.cancel()
        self.console.print(self.table())
        requests = self.result.requests + sum(r.requests for r in results)
        failed = self.result.failed + sum(r.failed for r in results)
        for result in results:
            self.console.print(result.line, markup=False, highlight=False)
        final = f"rehearsal: {ready} pods ready, {requests} requests, {failed} failed"
        self.console.print(final, markup=False, highlight=False)
        if self.experiment is not None:
            for line in self.experiment.lines():
                self.console.print(line, markup=False, highlight=False)
        if results or self.experiment is not None:
            path = rehearsal_report.write(results, self.stack, final, REPO_ROOT / "build" / "rehearsal",
                                          self.experiment)
            self.console.print(f"report: {path}")
        experiment_ok = self.experiment is None or self.experiment.ok
        # The three access cases hold (gateway.py: 401 without a key, a direct call refused, the keyed call served).
        access_ok = self.gateway is None or all(check.ok for check in self.gateway.access)
        if self.gateway is not None:
            for check in self.gateway.access:
                self.console.print(check.line, markup=False, highlight=False)
        return 0 if (not not_ready and failed == 0 and all(r.ok for r in results) and experiment_ok
                     and access_ok and not self.outside_image) else 1

    # -- the rollout scenarios ----------------------------------------------------------------------

    def _check_pods_in_image(self) -> None:
        """Every Ready pod's processes run in the image's root file system, not this machine's (each container's
        processes share its mount namespace: all of them are counted)."""
        counts = []
        for runner in self.node.runners:
            pid = runner.process.container_pid() if runner.process is not None else None
            if pid is None or not container.in_image_root(pid, REPO_ROOT):
                self.outside_image.append(runner.plan.name)
                self.console.print(f"[red]pod {runner.plan.name}[/]: its container's process {pid} does not run in "
                                   f"{self.image}'s root file system")
                continue
            counts.append(container.processes_in_mount_namespace(pid))
        self.console.print(f"pods in the image: {len(counts)} containers of {self.image}, {sum(counts)} processes, "
                           "each in the image's root file system", markup=False, highlight=False)

    def _start_gateway(self, rendered: render.Rendered, targets: Path) -> RehearsalGateway:
        """The gateway (gateway.py), started once: the experiment and then the scenarios go through the same one."""
        if self.gateway is not None:
            return self.gateway
        self.gateway = create_gateway(rendered, self.workdir / "gateway", self.node, free_port(),
                                      on_pods_changed=lambda: self._write_targets(targets))
        self.gateway.start(self.console)
        return self.gateway

    async def _scenarios(self, rendered: render.Rendered, targets: Path) -> list[scenarios.ScenarioResult]:
        gateway = self._start_gateway(rendered, targets)
        control = self.workdir / "control.sock"
        server = await gateway.cluster.serve(control)
        ctx = scenarios.Context(self.stack, self.workdir, gateway.cluster, control, self.prometheus.url, gateway.port,
                                gateway.domain, gateway.ca.httpx_verify(), self.console,
                                functools.partial(self.models.publish, console=self.console))
        ctx.copy_stacks()
        runs = scenarios.runnable(ctx, rendered.models, self.only_scenarios)
        results = []
        try:
            for name, run in runs:
                self.console.rule(f"scenario: {name}")
                result = await run()
                self.console.print(result.line, markup=False, highlight=False)
                results.append(result)
        finally:
            server.close()
        return results

    async def _experiment(self, rendered: render.Rendered, targets: Path) -> None:
        """The stack's experiment through the gateway with the client library, each arm's count on Prometheus beside
        the client's (experiment.py); its calls are requests of the run, its problems fail it."""
        outputs = parse_stack_outputs(rendered.outputs)
        chosen = experiment.choose(outputs)
        if chosen is None:
            self.console.print(f"[yellow]{self.stack} declares no experiment on an LLM "
                               f"({sorted(outputs.experiments) or 'none'}): no experiment through the gateway[/]")
            return
        name, declared = chosen
        gateway = self._start_gateway(rendered, targets)
        client = Client(outputs, gateway=GatewayEndpoints(f"127.0.0.1:{gateway.port}", str(gateway.ca.ca_path)),
                        timeout_s=120, api_key=secrets.run_key())
        unit_ids = experiment.units()
        try:
            with self.console.status(f"experiment {name}: {len(unit_ids)} {declared.unit}s x "
                                     f"{experiment.CALLS_PER_UNIT} calls through the gateway"):
                failures = await asyncio.to_thread(experiment.drive, client, name, unit_ids)
            stats = client.experiment_stats(name)
        finally:
            client.close()
        self.result.requests += sum(own.calls for own in stats.values())
        self.result.failed += len(failures)
        self.result.failures += failures
        expected = {arm: own.calls for arm, own in stats.items()}

        def read() -> dict[str, int]:
            return experiment.counts_from_vector(self.prometheus.api("query", query=experiment.query(name))["result"])

        with self.console.status(f"experiment {name}: waiting for Prometheus to scrape each arm's count"):
            counted = await experiment.await_counts(read, expected, timeout_s=experiment.SCRAPE_WAIT_S)
        self.experiment = experiment.compare(name, declared, unit_ids, stats, counted)
        for line in self.experiment.lines():
            self.console.print(line, markup=False, highlight=False)

    async def _traffic(self, rendered: render.Rendered) -> None:
        jobs = []
        for service_proxy, service in self.proxies:
            labels = service["inputs"]["metadata"].get("labels") or {}
            ports = {p["name"]: int(p["port"]) for p in service["inputs"]["spec"]["ports"]}
            jobs.append(traffic.drive(service_proxy.name, service_proxy.address, ports,
                                      labels.get("app.kubernetes.io/name", "?"), self.result))
        with self.console.status("traffic through every Service"):
            await asyncio.gather(*jobs)
        self.console.print(f"traffic: {self.result.requests} requests, {self.result.failed} failed")

    async def _observe(self, rendered: render.Rendered, targets: Path) -> None:
        prom = self.prometheus
        self._write_targets(targets)
        # The PodMonitor selects the model servers; the batch workers' pods are not its targets.
        servers = [r for r in self.node.runners
                   if r.plan.labels.get("app.kubernetes.io/component") == render.MODEL_SERVER]
        with self.console.status("waiting for Prometheus to scrape every pod through the PodMonitor"):
            deadline = time.monotonic() + 60
            up = None
            while time.monotonic() < deadline:
                up = prom.query_value('sum(up{app_kubernetes_io_component="model-server"})')
                seen = prom.query_value("count(vllm:num_requests_waiting)")
                if up is not None and up >= len(servers) and seen:
                    break
                await asyncio.sleep(2)
        self.console.print(f"Prometheus: {int(up or 0)} of {len(servers)} model pods up through the PodMonitor's "
                           "relabeling")
        if (up or 0) < len(servers):
            self.result.record("Prometheus scrape", False, f"only {int(up or 0)} pods up")
        groups = prom.api("rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        bad = [r["name"] for r in rules if r.get("health") not in ("ok", "unknown")]
        self.console.print(f"PrometheusRule: {len(groups)} group(s), {len(rules)} rule(s) loaded"
                           + (f", unhealthy: {bad}" if bad else ""))
        if bad:
            self.result.record("PrometheusRule", False, f"unhealthy rules {bad}")
        for so in rendered.of_type(render.SCALED_OBJECT):
            name = so["inputs"]["metadata"]["name"]
            try:
                scaler = Autoscaler.from_scaled_object(so["inputs"]["spec"])
            except ValueError as e:
                self.result.record(f"KEDA {name}", False, str(e))
                continue
            value = prom.query_value(scaler.query)
            current = sum(1 for r in self.node.runners if r.plan.deployment == scaler.target)
            decision = scaler.poll(0.0, value, current)
            self.console.print(f"KEDA {name}: {scaler.query} = {value} -> {decision.replicas} replica(s) "
                               f"({decision.reason}; {current} running, min {scaler.min_replicas}, "
                               f"max {scaler.max_replicas})")
            if value is None:
                self.result.record(f"KEDA query {name}", False, f"{scaler.query} returned no series")

    async def stop_pods(self, fast: bool = False) -> None:
        if self.node.runners:
            with self.console.status("terminating the pods (preStop, SIGTERM, grace period)"):
                await asyncio.gather(*(r.stop(fast=fast) for r in self.node.runners), return_exceptions=True)

    def cleanup(self) -> None:
        """Everything the run started, stopped and removed, whatever step it ended at (each part was held from
        the moment it existed); the network last but the mount points, which nothing runs in by then."""
        self.node.kill_pods()
        loop_free = [p for p, _ in self.proxies]
        for service_proxy in loop_free:
            for server in service_proxy.servers:
                server.close()
        if self.gateway is not None:
            self.gateway.stop()
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.store is not None:
            self.store.stop()
        self.net.close()


def main(argv: list[str] | None = None) -> int:
    return rehearse(options.parse(argv))


def rehearse(args) -> int:
    """One rehearsal with the options options.parse read."""
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)
    rehearsal = Rehearsal(args.stack, console)
    rehearsal.with_scenarios = not args.no_scenarios
    rehearsal.only_scenarios = tuple(args.scenarios or ())

    async def body() -> int:
        rendered = rehearsal.prepare()
        rehearsal.net.create_node()
        rehearsal.net.enter_node()
        fsx = rehearsal.setup_storage(rendered)
        plans = rehearsal.plans(rendered, fsx)
        return await rehearsal.run_async(rendered, plans)

    async def guarded() -> int:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        interrupted = []

        def on_signal() -> None:
            interrupted.append(1)
            if len(interrupted) == 1:
                console.print("[yellow]interrupted: terminating every pod and cleaning up (again: kill now)[/]")
                task.cancel()
            else:
                rehearsal.node.kill_pods()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            return await body()
        except asyncio.CancelledError:
            await rehearsal.stop_pods(fast=len(interrupted) > 1)
            return 130

    try:
        code = asyncio.run(guarded())
    except (RehearsalError, render.RenderError, storage.StorageError, podspec.PodSpecError,
            model_cache.ModelCacheError, StackOutputsError, experiment.ExperimentCheckError,
            scenarios.ScenarioError) as err:
        console.print(f"[red]rehearsal failed:[/] {err}")
        code = 1
    finally:
        rehearsal.cleanup()
    return code


if __name__ == "__main__":
    sys.exit(main())
