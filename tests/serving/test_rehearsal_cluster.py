"""The rehearsal's cluster (rehearsal/cluster.py) driven the way a rollout drives it: through
infra.rollout.remote.RemoteCluster, the client the rollout side's RehearsalRunner uses, over the control socket.

The pods are small HTTP servers started by the real kubelet (PodRunner: probes, back-off, preStop, SIGTERM) and the
gateway is a real HAProxy from Debian with the rehearsal's CA: what a rollout step does to the pods and the
proxy's routes is checked by requests through the proxy. No engine, no namespace (the pods listen on loopback
ports of their own); the whole rehearsal with vLLM pods runs in `make rehearse`.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from infra.rollout.remote import RemoteCluster
from infra.rollout.simulator import LiveResource, Node, UpdateError
from llm_serving.ports import free_port
from rehearsal import haproxy_config, haproxy_process, render
from rehearsal.cluster import RehearsalCluster
from rehearsal.kubelet import PodRunner
from rehearsal.podspec import PodPlan, Probe
from rehearsal.tls import CertificateAuthority

pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="function")]

DOMAIN = "llm.test"
HOST = f"chat.{DOMAIN}"
ROUTE = "kubernetes:gateway.networking.k8s.io/v1:HTTPRoute"

# A pod: answers GET with its own name, or (mode "crash") exits at once.
_POD = textwrap.dedent('''
    import http.server, signal, sys
    port, name, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if mode == "crash":
        sys.exit(3)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = name.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def _deployment(version: str, replicas: int, mode: str = "ok") -> dict:
    labels = {"app.kubernetes.io/name": "chat", "app.kubernetes.io/version": version,
              "app.kubernetes.io/component": render.MODEL_SERVER}
    return {"metadata": {"name": f"chat-{version}", "namespace": "ns", "labels": labels},
            "spec": {"replicas": replicas, "template": {"metadata": {"labels": labels}, "spec": {"mode": mode}}}}


def _service(version: str) -> dict:
    return {"metadata": {"name": f"chat-{version}", "namespace": "ns",
                         "labels": {"app.kubernetes.io/name": "chat", "app.kubernetes.io/version": version}},
            "spec": {"selector": {"app.kubernetes.io/name": "chat", "app.kubernetes.io/version": version},
                     "ports": [{"name": "http", "port": 8000, "targetPort": "http"}]}}


def _route(weights: dict[str, int]) -> dict:
    return {"metadata": {"name": "chat", "namespace": "ns"},
            "spec": {"parentRefs": [{"name": "gw", "sectionName": "https"}], "hostnames": [HOST],
                     "rules": [{"backendRefs": [{"name": f"chat-{v}", "port": 8000, "weight": w}
                                                for v, w in weights.items()]}]}}


GATEWAY = {"type": "kubernetes:gateway.networking.k8s.io/v1:Gateway", "name": "gw",
           "inputs": {"metadata": {"name": "gw", "namespace": "ns"},
                      "spec": {"listeners": [{"name": "https", "port": 443, "protocol": "HTTPS",
                                              "hostname": f"*.{DOMAIN}"}]}}}


class Harness:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.runners: list[PodRunner] = []
        self.tasks: list[asyncio.Task] = []
        self.ca = CertificateAuthority.create(workdir / "ca")
        certificate = self.ca.issue([f"*.{DOMAIN}"], workdir / "tls")
        self.port = free_port()
        self.haproxy = haproxy_process.HAProxy(workdir / "gw")
        self.haproxy.workdir.mkdir()
        settings = haproxy_config.Settings(binds={443: ("127.0.0.1", self.port)},
                                           admin_socket=workdir / "gw" / "admin.sock",
                                           certificate=certificate.pem_path)
        resources = [GATEWAY, {"type": render.SERVICE, "name": "chat-1-Service", "inputs": _service("1")},
                     {"type": ROUTE, "name": "chat-HTTPRoute", "inputs": _route({"1": 100})}]
        self.cluster = RehearsalCluster(resources, self.runners, self.plans_for, self.add_pod, self.start_pod,
                                        self.haproxy, settings)
        self.haproxy.start(self.cluster.proxy_config())
        self.remote = RemoteCluster(workdir / "control.sock", timeout_s=120)

    def plans_for(self, deployment: dict) -> list[PodPlan]:
        inputs = deployment["inputs"]
        name, mode = inputs["metadata"]["name"], inputs["spec"]["template"]["spec"]["mode"]
        plans = []
        for i in range(inputs["spec"]["replicas"]):
            port = free_port()
            probe = dict(port=port, period_s=0.1, timeout_s=2)
            plans.append(PodPlan(
                name=f"{name}-{i}", deployment=name, namespace="ns",
                labels=inputs["spec"]["template"]["metadata"]["labels"],
                argv=[sys.executable, "-c", _POD, str(port), f"{name}-{i}", mode], env={}, rendered_env={},
                mounts=[], uid=0, gid=0, groups=[], read_only_root=False, no_new_privs=False, workdir="/",
                ports={"http": port},
                probes={"startup": Probe("startup", "/", failure_threshold=300, **probe),
                        "readiness": Probe("readiness", "/", failure_threshold=2, **probe)},
                grace_period_s=2, prestop_sleep_s=0.2))
        return plans

    def add_pod(self, plan: PodPlan, on_change) -> PodRunner:
        import subprocess

        def launch(plan: PodPlan, log: Path) -> subprocess.Popen:
            with open(log, "w") as out:
                return subprocess.Popen(plan.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        runner = PodRunner(plan, "127.0.0.1", launch, self.workdir, backoff=lambda n: 0.05 * n, on_change=on_change)
        self.runners.append(runner)
        return runner

    def start_pod(self, runner: PodRunner) -> None:
        self.tasks.append(asyncio.create_task(runner.run()))

    async def step(self, type_: str, name: str, inputs: dict) -> int:
        """One rollout step as the RehearsalRunner sends it (the blocking client in a thread). The resource's Pulumi
        name is not its Kubernetes name, as the program's are not (`<name>-deployment`)."""
        return await asyncio.to_thread(self.remote.apply, Node(type_, f"{name}-{type_.rsplit(':', 1)[-1]}", inputs),
                                       None)

    async def delete(self, type_: str, name: str, inputs: dict) -> None:
        await asyncio.to_thread(self.remote.delete, LiveResource(type_, f"{name}-{type_.rsplit(':', 1)[-1]}", inputs))

    async def get(self) -> httpx.Response:
        async with httpx.AsyncClient(verify=self.ca.httpx_verify(), timeout=10) as client:
            return await client.get(f"https://127.0.0.1:{self.port}/", headers={"Host": HOST},
                                    extensions={"sni_hostname": HOST})

    async def close(self) -> None:
        await asyncio.gather(*(r.stop(fast=True) for r in self.runners), return_exceptions=True)
        for task in self.tasks:
            task.cancel()
        self.haproxy.stop()


@pytest_asyncio.fixture(loop_scope="function")
async def harness():
    # short: unix socket paths are limited to 107 bytes
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rh-cl-", ignore_cleanup_errors=True) as d:  # haproxy's log
        h = Harness(Path(d))
        server = await h.cluster.serve(h.workdir / "control.sock")
        try:
            yield h
        finally:
            server.close()
            await h.close()


async def test_a_deployment_step_returns_once_its_pods_are_ready_and_the_proxy_routes_to_them(harness):
    assert (await harness.get()).status_code == 503  # the route's backend has no Ready pod yet
    assert await harness.step(render.DEPLOYMENT, "chat-1", _deployment("1", 2)) == 2
    assert all(r.status.ready for r in harness.runners) and len(harness.runners) == 2
    answers = {(await harness.get()).text for _ in range(6)}
    assert answers == {"chat-1-0", "chat-1-1"}  # round robin over both Ready pods
    assert harness.cluster.pods.peak == {"chat": 2}


async def test_routed_hosts_name_the_host_a_route_gives_each_ready_pod(harness):
    assert harness.cluster.routed_hosts() == {}  # no Ready pod yet: nothing a caller could reach
    await harness.step(render.DEPLOYMENT, "chat-1", _deployment("1", 2))
    await harness.step(render.SERVICE, "chat-2", _service("2"))
    await harness.step(render.DEPLOYMENT, "chat-2", _deployment("2", 1))  # Ready, but no route sends to it
    assert harness.cluster.routed_hosts() == {"chat-1-0": HOST, "chat-1-1": HOST}


async def test_route_weights_move_traffic_and_scaling_down_terminates_the_extra_pods(harness):
    await harness.step(render.DEPLOYMENT, "chat-1", _deployment("1", 1))
    await harness.step(render.SERVICE, "chat-2", _service("2"))
    assert await harness.step(render.DEPLOYMENT, "chat-2", _deployment("2", 1)) == 1
    await harness.step(ROUTE, "chat", _route({"1": 0, "2": 100}))
    assert {(await harness.get()).text for _ in range(4)} == {"chat-2-0"}
    assert harness.cluster.pods.peak == {"chat": 2}
    assert await harness.step(render.DEPLOYMENT, "chat-1", _deployment("1", 0)) == 0
    assert [r.plan.name for r in harness.runners] == ["chat-2-0"]  # the old pod terminated and gone
    await harness.delete(render.DEPLOYMENT, "chat-2", _deployment("2", 1))
    assert harness.runners == [] and harness.cluster.pods.now == {}


async def test_a_crash_looping_candidate_fails_its_step_with_fewer_pods_ready(harness):
    assert await harness.step(render.DEPLOYMENT, "chat-3", _deployment("3", 1, mode="crash")) == 0
    assert harness.runners[0].status.restarts >= 3 and not harness.runners[0].status.ready


async def test_a_changed_pod_template_is_refused_by_name_through_the_control_socket(harness):
    await harness.step(render.DEPLOYMENT, "chat-1", _deployment("1", 1))
    changed = _deployment("1", 1)
    changed["spec"]["template"]["spec"]["mode"] = "other"
    with pytest.raises(UpdateError, match="Deployment chat-1: its pod template changed"):
        await harness.step(render.DEPLOYMENT, "chat-1", changed)
