"""The rehearsal's cluster: what the Kubernetes provider, the cluster and the gateway do with each step of a stack
update, on this machine (docs/rehearsal.md, "Rollouts").

`llm-serving rollout ... --runner rehearsal` (infra.rollout.runner.RehearsalRunner, in .venv-infra) renders each
update with the real program under the mock runtime and plays it in Pulumi's order (infra.rollout.simulator); every
step comes here over the control socket, one at a time, and returns when it is done:

- a model Deployment or a batch worker's (render.POD_COMPONENTS): its pods are started (a new Deployment, or more
  replicas) and the step waits, as the provider's await logic does, until all of them pass their readiness probes;
  it fails (fewer ready than asked) when the pods crash-loop or the startup budget of their probes runs out. Fewer
  replicas: the pods beyond the new count are terminated as Kubernetes terminates them (out of the endpoints at
  once, preStop, SIGTERM, the grace period). A changed pod template is refused by name: the scenarios never change
  one in place;
- an HTTPRoute or GRPCRoute: its backendRefs and weights go to the real proxy (haproxy_config.py renders them,
  haproxy_process.py applies them), weights in place through HAProxy's runtime API, anything else with a seamless
  reload; the Gateway's BackendTrafficPolicy (its retries, gateway_retry.py) goes there too;
- any other resource (Services, PodMonitors, ScaledObjects, ...) is recorded: the proxy reads Services' selectors,
  the rest changes nothing here;
- a delete: a Deployment's pods are terminated, a route leaves the proxy.

Whenever a pod's readiness changes the proxy's endpoints follow (kube-proxy's and the gateway's job), and the pods
running per model are counted: the peak is the GPU budget the planner promised (replicas + surge).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rehearsal import gateway_retry, gateway_routes, haproxy_config, render
from rehearsal.haproxy_process import HAProxy
from rehearsal.kubelet import PodRunner
from rehearsal.podspec import PodPlan, startup_budget_s

log = logging.getLogger(__name__)

ROUTE_TYPES = (gateway_routes.HTTP_ROUTE, gateway_routes.GRPC_ROUTE)
NAME_LABEL = "app.kubernetes.io/name"
VERSION_LABEL = "app.kubernetes.io/version"
CRASH_LOOP_RESTARTS = 3  # a pod restarted this often while its Deployment's step waits: the step fails
# Kubernetes' default progressDeadlineSeconds: how long a Deployment may make no progress before it is reported as
# failed, which ends the Kubernetes provider's await (the program sets none).
PROGRESS_DEADLINE_S = 600


class ClusterError(RuntimeError):
    """A step the rehearsal cannot carry out; its message goes back to the rollout as the update's failure."""


def _template(inputs: dict[str, Any]) -> Any:
    return (inputs.get("spec") or {}).get("template")


def _replicas(inputs: dict[str, Any]) -> int:
    value = (inputs.get("spec") or {}).get("replicas")
    return int(value) if value is not None else 1


def _k8s_name(inputs: dict[str, Any], default: str) -> str:
    return (inputs.get("metadata") or {}).get("name") or default


def _runs_pods(type_: str, inputs: dict[str, Any]) -> bool:
    """A Deployment whose pods the rehearsal runs (a model server or a batch worker, render.POD_COMPONENTS). Any
    other Deployment would be recorded only and count 0 Ready pods, failing the update that touches it."""
    return type_ == render.DEPLOYMENT and render.component(inputs) in render.POD_COMPONENTS


def _images(template: Any) -> list[str]:
    return [c.get("image") for c in ((template or {}).get("spec") or {}).get("containers") or []]


def template_change(name: str, previous: dict[str, Any], inputs: dict[str, Any]) -> str:
    """Why a Deployment's changed pod template is refused, naming what changed. The image changes when any file of
    its build context does (infra/image_context.py): a commit to llm_serving/, serving_image/, infra/ or policies/
    while the rehearsal runs re-renders every Deployment with a new digest."""
    before, after = _images(_template(previous)), _images(_template(inputs))
    if before != after:
        return (f"Deployment {name}: its image changed during the rehearsal ({', '.join(before)} -> "
                f"{', '.join(after)}): a file of the serving image's build context (llm_serving/, serving_image/, "
                f"infra/, policies/) changed since the stack was brought up; rehearse a tree nobody edits meanwhile "
                f"(a clone)")
    return (f"Deployment {name}: its pod template changed; the rehearsal starts and stops pods, it does not roll a "
            "template in place")


@dataclass
class PodCount:
    """Pods holding a node's resources (created and not yet terminated) per model, now and at the most."""

    now: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)

    def update(self, runners: list[PodRunner]) -> None:
        now: dict[str, int] = {}
        for runner in runners:
            if runner.status.phase != "Terminated":
                model = runner.plan.labels.get(NAME_LABEL, runner.plan.deployment)
                now[model] = now.get(model, 0) + 1
        self.now = now
        for model, count in now.items():
            self.peak[model] = max(self.peak.get(model, 0), count)

    def reset_peaks(self) -> None:
        self.peak = dict(self.now)


class RehearsalCluster:
    """The live objects of one stack and what runs for them. `add_pod(plan, on_change)` and `start_pod(runner)` are
    the rehearsal's (a network namespace per pod, the launcher); `plans_for(deployment)` its pod plans."""

    def __init__(self, resources: list[dict[str, Any]], runners: list[PodRunner],
                 plans_for: Callable[[dict[str, Any]], list[PodPlan]],
                 add_pod: Callable[..., PodRunner], start_pod: Callable[[PodRunner], None],
                 haproxy: HAProxy, settings: haproxy_config.Settings,
                 on_pods_changed: Callable[[], None] = lambda: None):
        self.objects: dict[tuple[str, str], dict[str, Any]] = {(r["type"], r["name"]): r["inputs"]
                                                                for r in resources}
        self.gateway = gateway_routes.gateway_from_rendered(resources)
        self.runners = runners  # the rehearsal's list: pods are added and removed in place
        self.plans_for = plans_for
        self.add_pod = add_pod
        self.start_pod = start_pod
        self.haproxy = haproxy
        self.settings = settings
        self.on_pods_changed = on_pods_changed
        self.pods = PodCount()
        self.events: list[str] = []  # what each step did, in order (the report's timeline)
        self._proxy_lock = asyncio.Lock()
        self.pods.update(runners)
        for runner in runners:
            runner.on_change = self.pod_changed

    # -- the proxy ---------------------------------------------------------------------------------------------

    def _resources(self, *types: str) -> list[dict[str, Any]]:
        return [{"type": t, "name": n, "inputs": i} for (t, n), i in self.objects.items() if t in types]

    def endpoints(self) -> gateway_routes.Endpoints:
        out: dict[tuple[str, int], list[gateway_routes.Endpoint]] = {}
        for service in self._resources(render.SERVICE):
            spec = service["inputs"].get("spec") or {}
            selector = spec.get("selector") or {}
            namespace = (service["inputs"].get("metadata") or {}).get("namespace")
            ready = [_PodEndpoint(r.plan.name, r.status.address, r.plan.ports) for r in self.runners
                     if r.status.ready and r.plan.namespace == namespace and render.selects(selector, r.plan.labels)]
            out.update(gateway_routes.endpoints_for_service(service, ready))
        return out

    def routed_hosts(self) -> dict[str, str]:
        """Each Ready pod an HTTPRoute reaches -> one hostname of that route (the host a caller names to reach it)."""
        endpoints = self.endpoints()
        hosts: dict[str, str] = {}
        for route in gateway_routes.routes_from_rendered(self._resources(*ROUTE_TYPES)):
            if route.grpc or not route.hostnames:
                continue
            for rule in route.rules:
                for backend in rule.backends:
                    for endpoint in endpoints.get((backend.service, backend.port), ()):
                        hosts.setdefault(endpoint.pod, route.hostnames[0])
        return hosts

    def proxy_config(self) -> haproxy_config.ProxyConfig:
        routes = gateway_routes.routes_from_rendered(self._resources(*ROUTE_TYPES))
        retry = gateway_retry.retry_from_rendered(self._resources(gateway_retry.BACKEND_TRAFFIC_POLICY), self.gateway)
        return haproxy_config.render_config(self.gateway, routes, self.endpoints(), self.settings, retry)

    async def refresh_proxy(self) -> None:
        """Bring the proxy to the live routes and Ready pods; one apply at a time, each from the state as it is when
        its turn comes (an unchanged configuration is not applied again)."""
        async with self._proxy_lock:
            await asyncio.to_thread(self.haproxy.apply, self.proxy_config())

    def pod_changed(self) -> None:
        self.pods.update(self.runners)
        self.on_pods_changed()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self.haproxy.process is not None:
            loop.create_task(self.refresh_proxy())

    # -- steps -------------------------------------------------------------------------------------------------

    async def apply(self, type_: str, name: str, inputs: dict[str, Any]) -> int:
        """`name` is the resource's Pulumi name; pods belong to the Deployment's Kubernetes name (metadata.name)."""
        key = (type_, name)
        previous = self.objects.get(key)
        if _runs_pods(type_, inputs):
            name = _k8s_name(inputs, name)
            if previous is not None and _template(previous) != _template(inputs):
                raise ClusterError(template_change(name, previous, inputs))
            self.objects[key] = inputs
            ready = await self._scale(name, inputs)
            # The Ready pods are in the proxy's endpoints before the step ends: the next step (a route's weights)
            # must never send traffic to a Service whose endpoints the proxy has not taken yet.
            await self.refresh_proxy()
            self.events.append(f"Deployment {name}: {ready}/{_replicas(inputs)} ready")
            return ready
        self.objects[key] = inputs
        if type_ in (*ROUTE_TYPES, render.SERVICE, gateway_retry.BACKEND_TRAFFIC_POLICY):
            await self.refresh_proxy()
            if type_ in ROUTE_TYPES:
                self.events.append(f"{type_.rsplit(':', 1)[-1]} {name}: {self._weights(inputs)}")
        return 0

    async def delete(self, type_: str, name: str, inputs: dict[str, Any]) -> None:
        previous = self.objects.pop((type_, name), None)
        if previous is not None and _runs_pods(type_, previous):
            name = _k8s_name(previous, name)
            await self._stop([r for r in self.runners if r.plan.deployment == name])
            self.events.append(f"Deployment {name}: deleted")
        elif type_ in (*ROUTE_TYPES, render.SERVICE, gateway_retry.BACKEND_TRAFFIC_POLICY):
            await self.refresh_proxy()

    @staticmethod
    def _weights(inputs: dict[str, Any]) -> str:
        refs = [ref for rule in (inputs.get("spec") or {}).get("rules") or [] for ref in rule.get("backendRefs") or []]
        return ", ".join(f"{ref['name']}={ref.get('weight', 1)}" for ref in refs)

    async def _scale(self, name: str, inputs: dict[str, Any]) -> int:
        want = _replicas(inputs)
        current = [r for r in self.runners if r.plan.deployment == name and r.status.phase != "Terminated"]
        if want < len(current):
            await self._stop(current[want:])
            current = current[:want]
        elif want > len(current):
            plans = self.plans_for({"type": render.DEPLOYMENT, "name": name, "inputs": inputs})
            taken = {r.plan.name for r in current}
            for plan in [p for p in plans if p.name not in taken][:want - len(current)]:
                runner = self.add_pod(plan, self.pod_changed)
                self.start_pod(runner)
                current.append(runner)
            self.pod_changed()
        deadline = float((inputs.get("spec") or {}).get("progressDeadlineSeconds") or PROGRESS_DEADLINE_S)
        return await self._await_ready(current, want, deadline)

    async def _await_ready(self, pods: list[PodRunner], want: int, deadline_s: float) -> int:
        """The provider's await: until every pod is Ready, or a pod crash-loops, or the Deployment's progress
        deadline passes (and never before its probes' startup budget is spent)."""
        if not pods:
            return 0
        budget = max([deadline_s, *(startup_budget_s(p.plan.probes.get("startup")) + 60 for p in pods)])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        while loop.time() < deadline:
            ready = sum(r.status.ready for r in pods)
            if ready >= want or any(r.status.restarts >= CRASH_LOOP_RESTARTS for r in pods):
                return min(ready, want)
            await asyncio.sleep(0.5)
        return min(sum(r.status.ready for r in pods), want)

    async def _stop(self, pods: list[PodRunner]) -> None:
        """Terminate as Kubernetes does; the pods leave the endpoints as their termination begins."""
        await asyncio.gather(*(r.stop() for r in pods), return_exceptions=True)
        for runner in pods:
            if runner in self.runners:
                self.runners.remove(runner)
        self.pod_changed()

    # -- the control socket ------------------------------------------------------------------------------------

    async def serve(self, path: Path) -> asyncio.AbstractServer:
        """One JSON request per connection, one JSON answer (infra.rollout.runner.RemoteCluster speaks it)."""

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                request = json.loads(await reader.readline())
                if request.get("op") == "apply":
                    answer: dict[str, Any] = {"ready": await self.apply(request["type"], request["name"],
                                                                        request["inputs"])}
                elif request.get("op") == "delete":
                    await self.delete(request["type"], request["name"], request["inputs"])
                    answer = {"ok": True}
                else:
                    answer = {"error": f"unknown operation {request.get('op')!r}"}
            except ClusterError as err:
                answer = {"error": str(err)}
            except Exception as err:  # noqa: BLE001 - reported to the rollout as the step's failure, and logged
                log.exception("rehearsal cluster step failed")
                answer = {"error": f"the rehearsal failed to carry out the step: {type(err).__name__}: {err}"}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
            writer.close()

        return await asyncio.start_unix_server(handle, path=str(path))


@dataclass(frozen=True)
class _PodEndpoint:
    pod: str
    address: str
    ports: dict[str, int]
