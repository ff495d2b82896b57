"""The seam `make rehearse` checks for an experiment (rehearsal/experiment.py, docs/rehearsal.md,
"An experiment through the gateway"): the experiment the dev stack declares, rendered into its stack outputs by the
program, read by the client library, whose assignment picks each user's arm and whose header carries it through the
real HAProxy gateway (the dev stack's rendered Gateway and routes, the rehearsal's CA) to the real OpenAI front-end,
which counts the arm on its metrics; a real Prometheus scrapes them through the dev stack's PodMonitor, and the
rehearsal's comparison sets each arm's count there beside the client's.

The "pod" is the OpenAI front-end (serving_image/openai_api) on a fake engine that answers every chat at once: no
vLLM, no Triton. Its metrics are this process's prometheus_client registry, served as the pod's metrics port would
serve them. Counts are asserted, never times; the assignment is a pure function, so the arms' units are the same in
every run.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import prometheus_client
import pytest
import uvicorn

from llm_serving.ports import free_port
from llm_serving.stack_outputs import parse_stack_outputs
from llm_serving_client import Client, GatewayEndpoints, GatewayError, LocalEndpoints, assign
from llm_serving_client.experiments import ArmStats
from rehearsal import (
    experiment,
    gateway_retry,
    gateway_routes,
    haproxy_config,
    haproxy_process,
    observe,
    render,
    report,
)
from rehearsal.services import Endpoint
from rehearsal.tls import CertificateAuthority
from serving_image.openai_api.app import create_app
from serving_image.served_model import ChoiceDelta, GenerationOutput, GenerationRequest, ModelInfo, ServedModel

pytestmark = pytest.mark.timeout(180)

MODEL = "chat-small"  # the dev stack's LLM, on which its experiment runs


class AnsweringModel(ServedModel):
    """Answers every request with one token and a "stop" finish."""

    info = ModelInfo(name=MODEL, version="1.0.0", max_model_len=256, vocab_size=100, eos_token_id=0)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        choices = tuple(ChoiceDelta(i, "a", (97,), None, "stop") for i in range(request.sampling.n))
        yield GenerationOutput(request.request_id, len(request.prompt), choices, finished=True)

    async def abort(self, request_id: str) -> None:
        pass

    def is_ready(self) -> bool:
        return True

    @property
    def dead_reason(self) -> str | None:
        return None

    def encode_prompt(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return [ord(c) % self.info.vocab_size for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "a" * len(token_ids)

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        return "\n".join(str(m.get("content")) for m in messages)

    async def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def dev() -> render.Rendered:
    return render.render("dev-us-east-1")


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="rh-exp-") as d:  # short: HAProxy's admin socket path
        yield Path(d)


@pytest.fixture(scope="module")
def pod():
    """The OpenAI front-end on 127.0.0.1 (what the chat-small Service's openai port reaches) and its metrics port."""
    server = uvicorn.Server(uvicorn.Config(create_app(AnsweringModel()), host="127.0.0.1", port=free_port(),
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:  # a readiness wait, not an assertion on time
        assert thread.is_alive(), "the OpenAI front-end did not start"
        time.sleep(0.05)
    metrics_port = free_port()
    metrics, metrics_thread = prometheus_client.start_http_server(metrics_port, addr="127.0.0.1")
    yield server.config.port, metrics_port
    metrics.shutdown()
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def gateway(dev, pod, workdir):
    """The dev stack's Gateway, routes and retry policy as HAProxy, chat-small's Service over the one pod."""
    openai_port, _ = pod
    ca = CertificateAuthority.create(workdir / "ca")
    domain = dev.config["llm-serving:serving"]["domain"]
    certificate = ca.issue([f"*.{domain}", f"*.grpc.{domain}"], workdir / "tls")
    endpoints = {}
    for service in dev.model_services():
        labels = service["inputs"]["metadata"].get("labels") or {}
        names = [p.get("targetPort") for p in service["inputs"]["spec"]["ports"]]
        pods = ([Endpoint("chat-small-0", "127.0.0.1", {n: openai_port for n in names if isinstance(n, str)})]
                if labels.get("app.kubernetes.io/name") == MODEL else [])
        endpoints.update(gateway_routes.endpoints_for_service(service, pods))
    port = free_port()
    settings = haproxy_config.Settings(binds={443: ("127.0.0.1", port)}, admin_socket=workdir / "admin.sock",
                              certificate=certificate.pem_path)
    rendered_gateway = gateway_routes.gateway_from_rendered(dev.resources)
    haproxy = haproxy_process.HAProxy(workdir / "haproxy")
    routes = gateway_routes.routes_from_rendered(dev.resources)
    retry = gateway_retry.retry_from_rendered(dev.resources, rendered_gateway)
    haproxy.start(haproxy_config.render_config(rendered_gateway, routes, endpoints, settings, retry))
    yield GatewayEndpoints(f"127.0.0.1:{port}", str(ca.ca_path))
    haproxy.stop()


@pytest.fixture(scope="module")
def prometheus(dev, pod, workdir):
    """A real Prometheus with the scrape job of the dev stack's PodMonitor, the pod discovered as Kubernetes would
    report it. The one change: a 1 s scrape interval instead of the rendered 15 s, so the test waits less."""
    _, metrics_port = pod
    (monitor,) = dev.of_type(render.POD_MONITOR)
    targets = workdir / "targets.json"
    jobs = observe.scrape_config(monitor["inputs"], targets)
    for job in jobs:
        job["scrape_interval"] = "1s"
    deployment = next(d for d in dev.model_deployments()
                      if d["inputs"]["metadata"]["labels"]["app.kubernetes.io/name"] == MODEL)
    template = deployment["inputs"]["spec"]["template"]
    port_names = [p["name"] for c in template["spec"]["containers"] for p in c.get("ports") or []]
    targets.write_text(json.dumps(observe.pod_targets(
        "chat-small-0", deployment["inputs"]["metadata"]["namespace"], "127.0.0.1", template["metadata"]["labels"],
        {name: metrics_port for name in port_names}, True)))
    prom = observe.Prometheus(workdir / "prometheus", free_port())
    prom.write_config(jobs, {"groups": []})
    prom.start()
    yield prom
    prom.stop()


def test_the_dev_stacks_experiment_is_rendered_into_its_outputs(dev):
    """The stack declares it; the program renders it; the client's reader reads it, and the rehearsal picks it."""
    outputs = parse_stack_outputs(dev.outputs)
    name, declared = experiment.choose(outputs)
    assert name == "chat-small-temperature" and declared.unit == "user"
    assert [(a.name, a.model, a.version, a.parameters, a.percent) for a in declared.arms] == [
        ("control", MODEL, None, {}, 50), ("cool", MODEL, None, {"temperature": 0.2}, 50)]
    # the rehearsal's fixed users reach both arms (a pure function: the same split every run)
    arms = [assign(name, unit, declared.arms) for unit in experiment.units()]
    assert len(arms) == 40 and set(arms) == {"control", "cool"}


def test_both_arms_through_the_gateway_are_counted_on_prometheus_as_the_client_sent_them(dev, gateway, prometheus):
    outputs = parse_stack_outputs(dev.outputs)
    name, declared = experiment.choose(outputs)
    client = Client(outputs, gateway=gateway, timeout_s=30)
    unit_ids = experiment.units()
    try:
        assert experiment.drive(client, name, unit_ids) == []
        stats = client.experiment_stats(name)
    finally:
        client.close()
    expected = {arm: own.calls for arm, own in stats.items()}
    assert sum(expected.values()) == len(unit_ids) * experiment.CALLS_PER_UNIT

    def read() -> dict[str, int]:
        return experiment.counts_from_vector(prometheus.api("query", query=experiment.query(name))["result"])

    counted = asyncio.run(experiment.await_counts(read, expected, timeout_s=60, every_s=0.5))
    check = experiment.compare(name, declared, unit_ids, stats, counted)
    assert check.ok, check.lines()
    by_arm = {a.arm: a for a in check.arms}
    for arm in ("control", "cool"):
        units = [u for u in unit_ids if assign(name, u, declared.arms) == arm]
        assert by_arm[arm].units == len(units) > 0
        assert by_arm[arm].prometheus == by_arm[arm].client_calls == len(units) * experiment.CALLS_PER_UNIT
    assert check.lines()[-1] == f"experiment {name}: every arm counted on Prometheus as the client sent it"


def test_an_arm_prometheus_missed_or_miscounted_fails_naming_the_experiment_and_the_arm(dev):
    outputs = parse_stack_outputs(dev.outputs)
    name, declared = experiment.choose(outputs)
    unit_ids = experiment.units()
    stats = {"control": ArmStats(calls=4), "cool": ArmStats(calls=6)}
    check = experiment.compare(name, declared, unit_ids, stats, {"control": 4})
    assert not check.ok and check.problems == (
        f"experiment {name} arm cool: no request counted on the rehearsal's Prometheus "
        f"(llm_serving_experiment_requests_total); the client sent 6",)
    check = experiment.compare(name, declared, unit_ids, stats, {"control": 3, "cool": 6, "warm": 1})
    assert check.problems == (
        f"experiment {name} arm control: Prometheus counted 3 requests, the client sent 4",
        f"experiment {name} arm warm: counted on Prometheus (1), but the stack declares no such arm "
        f"(declared: ['control', 'cool'])")
    check = experiment.compare(name, declared, unit_ids[:1], stats, {"control": 4, "cool": 6})
    assert [p.split(":")[0] for p in check.problems] == [f"experiment {name} arm "
                                                         f"{a.name}" for a in declared.arms
                                                         if assign(name, unit_ids[0], declared.arms) != a.name]


def test_a_gateway_address_is_checked_and_excludes_local_endpoints(dev, tmp_path):
    with pytest.raises(GatewayError, match="gateway address '127.0.0.1' is not host:port"):
        GatewayEndpoints("127.0.0.1")
    with pytest.raises(GatewayError, match="gateway CA file .*missing.pem: no such file"):
        GatewayEndpoints("127.0.0.1:8443", str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="local endpoints and a gateway address contradict each other"):
        Client(parse_stack_outputs(dev.outputs), local=LocalEndpoints("http://127.0.0.1:9000/v1", "127.0.0.1:8001"),
               gateway=GatewayEndpoints("127.0.0.1:8443"))


def test_the_report_sets_each_arms_prometheus_count_beside_the_clients(dev, tmp_path):
    """`build/rehearsal/report.md` of a run without scenarios (`--no-scenarios`): the experiment's table alone."""
    outputs = parse_stack_outputs(dev.outputs)
    name, declared = experiment.choose(outputs)
    stats = {"control": ArmStats(calls=38), "cool": ArmStats(calls=42)}
    check = experiment.compare(name, declared, experiment.units(), stats, {"control": 38, "cool": 41})
    text = report.write([], "dev-us-east-1", "rehearsal: 4 pods ready, 104 requests, 0 failed", tmp_path,
                        check).read_text()
    units = {a.arm: a.units for a in check.arms}
    assert f"| control | 50 | {units['control']} | 38 | 0 | 38 | ok |" in text
    assert f"| cool | 50 | {units['cool']} | 42 | 0 | 41 | FAILED |" in text
    assert f"- experiment {name} arm cool: Prometheus counted 41 requests, the client sent 42" in text
    assert f"experiment {name}: FAILED" in text and not (tmp_path / "rollouts.png").exists()
