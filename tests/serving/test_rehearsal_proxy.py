"""The Gateway API routes realised by a real HAProxy (rehearsal/: gateway_routes.py and
gateway_retry.py read the rendered objects, haproxy_config.py renders the configuration, haproxy_process.py runs it)
behind the rehearsal's own certificate authority (tls.py), with real requests: HTTP/1.1 with httpx and gRPC over
HTTP/2 with grpcio, both over TLS to loopback ports (no root, no namespace).

The "pods" here are stand-ins: each is a tiny HTTP/1.1 server and a gRPC (h2c) server on loopback in this process
that answer with the pod's name, so that every answer says which pod the proxy chose. The routes are shaped as the
program renders them (infra/serving.py `_routes`, infra/serving_platform.py's Gateway). Every assertion counts
requests (no timing): a weight-0 backend gets no request sent after the change; a 50/50 split gives each pod at
least a quarter of a phase's requests (HAProxy's weighted round robin on one thread alternates them); not one
request fails or one stream is cut short across weight changes and reloads.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509

from llm_serving.ports import free_port
from rehearsal import gateway_retry, gateway_routes, haproxy_config, haproxy_process
from rehearsal.gateway_routes import BackendRef, Endpoint, PathMatch, ProxyConfigError
from rehearsal.haproxy_config import Settings, server_weights
from rehearsal.haproxy_process import HAProxy
from rehearsal.tls import CertificateAuthority

pytestmark = pytest.mark.timeout(120)

DOMAIN = "models.rehearsal.test"
GRPC_SERVICE = "inference.GRPCInferenceService"
OPENAI, KSERVE_HTTP, KSERVE_GRPC = 9000, 8000, 8001  # the Service ports (llm_serving.pod_contract.PORTS)
STREAM_CHUNKS = 3


def test_haproxy_is_installed():
    """`make serving-env` installs Debian's haproxy beside prometheus; the rehearsal's gateway needs it."""
    assert shutil.which("haproxy"), "haproxy is missing: make serving-env installs it (apt-get install haproxy)"


# -- the rendered objects, shaped as the program renders them -------------------------------------------------


def gateway_resource() -> dict:
    tls = {"mode": "Terminate", "certificateRefs": [{"kind": "Secret", "name": "llm-serving-tls"}]}
    return {"type": gateway_routes.GATEWAY, "name": "platform-gateway", "inputs": {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": "llm-serving", "namespace": "llm-serving"},
        "spec": {"gatewayClassName": "envoy-gateway", "listeners": [
            {"name": "openai", "protocol": "HTTPS", "port": 443, "hostname": f"*.{DOMAIN}", "tls": tls,
             "allowedRoutes": {"namespaces": {"from": "Same"}, "kinds": [{"kind": "HTTPRoute"}]}},
            {"name": "grpc", "protocol": "HTTPS", "port": 443, "hostname": f"*.grpc.{DOMAIN}", "tls": tls,
             "allowedRoutes": {"namespaces": {"from": "Same"}, "kinds": [{"kind": "GRPCRoute"}]}}]}}}


def route_resources(name: str, label: str, backends: list[tuple[str, int]]) -> list[dict]:
    """infra/serving.py `_routes`: OpenAI under /v1 and KServe HTTP under /v2 on `<label>.<domain>`, KServe gRPC on
    `<label>.grpc.<domain>`, every rule with the same weighted backendRefs."""
    def refs(port: int) -> list[dict]:
        return [{"name": svc, "port": port, "weight": weight} for svc, weight in backends]

    meta = {"namespace": "llm-serving", "labels": {"app.kubernetes.io/name": name.split("-")[0]}}
    http = {"type": gateway_routes.HTTP_ROUTE, "name": f"{name}-http", "inputs": {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {**meta, "name": f"{name}-http"},
        "spec": {"parentRefs": [{"name": "llm-serving", "sectionName": "openai"}], "hostnames": [f"{label}.{DOMAIN}"],
                 "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}], "backendRefs": refs(OPENAI)},
                           {"matches": [{"path": {"type": "PathPrefix", "value": "/v2"}}],
                            "backendRefs": refs(KSERVE_HTTP)}]}}}
    grpc_route = {"type": gateway_routes.GRPC_ROUTE, "name": f"{name}-grpc", "inputs": {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GRPCRoute", "metadata": {**meta, "name": f"{name}-grpc"},
        "spec": {"parentRefs": [{"name": "llm-serving", "sectionName": "grpc"}],
                 "hostnames": [f"{label}.grpc.{DOMAIN}"],
                 "rules": [{"matches": [{"method": {"service": GRPC_SERVICE}}], "backendRefs": refs(KSERVE_GRPC)}]}}}
    return [http, grpc_route]


# -- stand-in pods ----------------------------------------------------------------------------------------------


class Pod:
    """A stand-in for a model pod: an HTTP/1.1 server (answers any GET/POST with its name, the path and the Host) and
    a gRPC h2c server (`ServerReady`, unary, answers its name; `ModelStreamInfer`, bidirectional, answers each request
    with STREAM_CHUNKS messages), both on loopback."""

    def __init__(self, name: str):
        self.name = name
        self.counts: Counter[str] = Counter()
        self.fail_status: int | None = None  # set: every HTTP request is answered with this status (a bad pod)
        self._lock = threading.Lock()
        pod = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if pod.fail_status is not None:
                    pod._count("http-failed")
                    body = b'{"error": "this pod serves errors"}'
                    self.send_response(pod.fail_status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                pod._count("http")
                body = json.dumps({"pod": pod.name, "path": self.path, "host": self.headers["Host"]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

        def ready(request: bytes, context) -> bytes:
            self._count("grpc")
            return self.name.encode()

        def stream(requests, context):
            self._count("stream")
            for request in requests:
                for i in range(STREAM_CHUNKS):
                    yield f"{self.name}:{request.decode()}:{i}".encode()

        self.grpc = grpc.server(ThreadPoolExecutor(max_workers=4))
        self.grpc.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(GRPC_SERVICE, {
            "ServerReady": grpc.unary_unary_rpc_method_handler(ready),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream)})])
        self.grpc_port = self.grpc.add_insecure_port("127.0.0.1:0")
        self.grpc.start()

    def _count(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    @property
    def http_port(self) -> int:
        return self.http.server_address[1]

    def endpoints(self, service: str) -> dict[tuple[str, int], list[Endpoint]]:
        """What a Service's ports resolve to for this pod (targetPort by name, as the program's Services do)."""
        return {(service, OPENAI): [Endpoint(self.name, "127.0.0.1", self.http_port)],
                (service, KSERVE_HTTP): [Endpoint(self.name, "127.0.0.1", self.http_port)],
                (service, KSERVE_GRPC): [Endpoint(self.name, "127.0.0.1", self.grpc_port)]}

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.grpc.stop(0)


def merge(*maps: dict) -> dict:
    out: dict = {}
    for m in maps:
        for key, value in m.items():
            out.setdefault(key, []).extend(value)
    return out


# -- clients trusting the rehearsal's CA ------------------------------------------------------------------------


@dataclass
class Gateway:
    port: int
    ca: CertificateAuthority

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(verify=kwargs.pop("verify", self.ca.httpx_verify()), timeout=10, **kwargs)

    def get(self, client: httpx.Client, host: str, path: str) -> httpx.Response:
        """A request for `https://<host><path>` sent to the proxy's loopback port (Host and SNI are the host)."""
        return client.get(f"https://127.0.0.1:{self.port}{path}", headers={"Host": host},
                          extensions={"sni_hostname": host})

    def channel(self, host: str, credentials=None) -> grpc.Channel:
        return grpc.secure_channel(f"127.0.0.1:{self.port}", credentials or self.ca.grpc_credentials(),
                                   options=[("grpc.ssl_target_name_override", host),
                                            ("grpc.default_authority", host)])


def ready(channel: grpc.Channel) -> str:
    return channel.unary_unary(f"/{GRPC_SERVICE}/ServerReady")(b"", timeout=10).decode()


def stream(channel: grpc.Channel, requests: int = 2) -> str:
    """One bidirectional stream; the pod's name when every message came back from one pod, intact."""
    call = channel.stream_stream(f"/{GRPC_SERVICE}/ModelStreamInfer")
    answers = [m.decode() for m in call(iter([str(i).encode() for i in range(requests)]), timeout=10)]
    expected = [f"{i}:{k}" for i in range(requests) for k in range(STREAM_CHUNKS)]
    pods = {a.split(":", 1)[0] for a in answers}
    if len(pods) != 1 or [a.split(":", 1)[1] for a in answers] != expected:
        raise AssertionError(f"stream cut short or mixed: {answers}")
    return pods.pop()


# -- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir():
    # short: unix socket paths are limited to 107 bytes
    with tempfile.TemporaryDirectory(prefix="rh-proxy-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def ca(workdir) -> CertificateAuthority:
    return CertificateAuthority.create(workdir / "ca")


@pytest.fixture(scope="module")
def certificate(ca, workdir):
    # the Certificate's dnsNames (infra/serving_platform.py): the two listeners' wildcards
    return ca.issue([f"*.{DOMAIN}", f"*.grpc.{DOMAIN}"], workdir / "tls")


@pytest.fixture(scope="module")
def pods():
    made = {name: Pod(name) for name in ("pod-a", "pod-b", "pod-c")}
    yield made
    for pod in made.values():
        pod.close()


def settings(workdir: Path, certificate, port: int) -> Settings:
    return Settings(binds={443: ("127.0.0.1", port)}, admin_socket=workdir / "admin.sock",
                    certificate=certificate.pem_path)


@pytest.fixture
def running(workdir, certificate, ca, request):
    """An HAProxy started by the test (`start(config)`), stopped at the end."""
    port = free_port()
    haproxy = HAProxy(workdir / request.node.name[:20])
    cfg = settings(haproxy.workdir, certificate, port)
    yield haproxy, cfg, Gateway(port, ca)
    haproxy.stop()


def render(resources: list[dict], endpoints: dict, cfg: Settings) -> haproxy_config.ProxyConfig:
    gateway = gateway_routes.gateway_from_rendered(resources)
    return haproxy_config.render_config(gateway, gateway_routes.routes_from_rendered(resources), endpoints, cfg,
                               gateway_retry.retry_from_rendered(resources, gateway))


def retry_policy_resource(**retry) -> dict:
    """The Gateway-wide BackendTrafficPolicy as infra/serving_platform.py renders it, from the same contract
    (llm_serving.pod_contract); `retry` replaces its retry section."""
    from llm_serving import pod_contract as pc

    section = retry or {"numRetries": pc.GATEWAY_RETRIES,
                        "retryOn": {"triggers": list(pc.GATEWAY_RETRY_TRIGGERS),
                                    "httpStatusCodes": list(pc.GATEWAY_RETRY_STATUS_CODES)}}
    return {"type": gateway_retry.BACKEND_TRAFFIC_POLICY, "name": "platform-gateway-backend-traffic", "inputs": {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "BackendTrafficPolicy",
        "metadata": {"name": "llm-serving", "namespace": "llm-serving"},
        "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "llm-serving"}],
                 "timeout": {"http": {"connectionIdleTimeout": f"{pc.GATEWAY_UPSTREAM_IDLE_TIMEOUT_S}s"}},
                 "retry": section}}}


# -- the translation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shares", "expected"), [
    ([(100, 1), (0, 1)], [1, 0]),
    ([(50, 1), (50, 1)], [1, 1]),
    ([(50, 1), (50, 2)], [2, 1]),  # a pod of the two-pod Service gets half the weight of the lone pod
    ([(30, 3), (70, 1)], [1, 7]),
    ([(0, 1), (0, 2)], [0, 0]),
    ([(1, 7), (100, 1)], [1, 256]),  # 1/7 : 100 scaled into 1..256: a share > 0 never rounds to 0
])
def test_server_weights_share_a_backendref_among_its_pods(shares, expected):
    assert server_weights(shares) == expected


def test_the_programs_routes_become_one_tls_frontend_routing_by_host_and_path(tmp_path, certificate):
    resources = [gateway_resource(), *route_resources("chat", "chat", [("chat-1-0", 90), ("chat-2-0", 10)])]
    a, b = (Endpoint(f"pod-{x}", "10.213.1.1", 9000) for x in "ab")
    endpoints = {("chat-1-0", OPENAI): [a], ("chat-2-0", OPENAI): [b], ("chat-1-0", KSERVE_GRPC): [a]}
    config = render(resources, endpoints, settings(tmp_path, certificate, 8443))
    text = config.text
    assert text.count("\nfrontend ") == 1  # both listeners are on 443
    assert f"bind 127.0.0.1:8443 ssl crt {certificate.pem_path} alpn h2,http/1.1" in text
    assert (f"use_backend httproute.chat-http.0 if {{ req.hdr(host),host_only,lower -m str chat.{DOMAIN} }} "
            "{ path -m str /v1 } || { req.hdr(host),host_only,lower -m str chat.models.rehearsal.test } "
            "{ path -m beg /v1/ }") in text
    assert (f"use_backend grpcroute.chat-grpc.0 if {{ req.hdr(host),host_only,lower -m str chat.grpc.{DOMAIN} }} "
            f"{{ path -m str /{GRPC_SERVICE} }}") in text
    assert config.weights[("httproute.chat-http.0", "chat-1-0.pod-a.9000")] == 9
    assert config.weights[("httproute.chat-http.0", "chat-2-0.pod-b.9000")] == 1
    # the KServe HTTP rule's Services have no Ready pod here: their shares fail (503), never go elsewhere
    assert config.weights[("httproute.chat-http.1", "chat-1-0.no-ready-endpoints")] == 9
    assert "server chat-2-0.no-ready-endpoints 127.0.0.1:1 weight 1\n" in text
    # gRPC backends speak h2c to the pods
    assert "server chat-1-0.pod-a.9000 10.213.1.1:9000 weight 9 proto h2" in text
    assert config.backends["grpcroute.chat-grpc.0"] == {"chat-1-0": 90, "chat-2-0": 10}
    HAProxy(tmp_path).check(text)  # and HAProxy 2.6 accepts it
    # the same routes at other weights: the same skeleton (a runtime weight change, no reload)
    moved = render([gateway_resource(), *route_resources("chat", "chat", [("chat-1-0", 50), ("chat-2-0", 50)])],
                   endpoints, settings(tmp_path, certificate, 8443))
    assert moved.skeleton == config.skeleton and moved.text != config.text


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r[1]["inputs"]["spec"].update(hostnames=["chat.elsewhere.test"]), "not under listener openai"),
    (lambda r: r[1]["inputs"]["spec"]["rules"][0]["matches"][0].update(headers=[{"name": "x", "value": "y"}]),
     "headers matches are not realised"),
    (lambda r: r[1]["inputs"]["spec"]["rules"][0].update(filters=[{"type": "URLRewrite"}]), "filters"),
    (lambda r: r[1]["inputs"]["spec"]["rules"][0]["matches"][0]["path"].update(type="RegularExpression"),
     "path match type RegularExpression"),
    (lambda r: r[1]["inputs"]["spec"]["parentRefs"][0].update(sectionName="nope"), "no listener"),
])
def test_what_the_proxy_does_not_realise_is_named(change, message, tmp_path, certificate):
    resources = [gateway_resource(), *route_resources("chat", "chat", [("chat-1-0", 100)])]
    change(resources)
    with pytest.raises(ProxyConfigError, match=message):
        render(resources, {}, settings(tmp_path, certificate, 8443))


def test_the_gateways_retry_policy_becomes_haproxys_retries_on_another_server(tmp_path, certificate):
    resources = [gateway_resource(), *route_resources("chat", "chat", [("chat-1-0", 50), ("chat-2-0", 50)]),
                 retry_policy_resource()]
    config = render(resources, {}, settings(tmp_path, certificate, 8443))
    backends = config.text.count("\nbackend ") - 1  # every route rule's backend, not no-route's
    assert backends == 3
    assert config.text.count("\n    retries 2  # BackendTrafficPolicy llm-serving\n") == backends
    assert config.text.count("\n    retry-on conn-failure empty-response 500 502 503 504\n") == backends
    assert config.text.count("\n    option redispatch 1") == backends
    assert config.text.count("\n    option http-buffer-request") == backends
    assert "    retries 0" in config.text  # the defaults: no retry where no policy says so
    HAProxy(tmp_path).check(config.text)
    without = render(resources[:-1], {}, settings(tmp_path, certificate, 8443))
    assert "retry-on" not in without.text


@pytest.mark.parametrize(("retry", "message"), [
    ({"numRetries": 2, "retryOn": {"triggers": ["unavailable"]}}, "retry trigger 'unavailable' is not realised"),
    ({"numRetries": 2, "retryOn": {"triggers": ["retriable-status-codes"], "httpStatusCodes": [505]}},
     r"cannot retry on status \[505\]"),
    ({"numRetries": 2, "retryOn": {"triggers": ["retriable-status-codes"]}}, "without httpStatusCodes"),
    ({"numRetries": 2, "retryOn": {"httpStatusCodes": [503]}}, "without the retriable-status-codes trigger"),
    ({"numRetries": 2, "retryOn": {"triggers": ["reset"]}, "perRetry": {"timeout": "1s"}}, "retry.perRetry"),
])
def test_what_haproxy_cannot_retry_is_named(retry, message, tmp_path, certificate):
    resources = [gateway_resource(), *route_resources("chat", "chat", [("chat-1-0", 100)]),
                 retry_policy_resource(**retry)]
    with pytest.raises(ProxyConfigError, match=message):
        render(resources, {}, settings(tmp_path, certificate, 8443))


def test_a_policy_attached_elsewhere_is_named(tmp_path, certificate):
    policy = retry_policy_resource()
    policy["inputs"]["spec"]["targetRefs"] = [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute",
                                               "name": "chat-http"}]
    resources = [gateway_resource(), *route_resources("chat", "chat", [("chat-1-0", 100)]), policy]
    with pytest.raises(ProxyConfigError, match="only a policy attached to Gateway llm-serving"):
        render(resources, {}, settings(tmp_path, certificate, 8443))


def test_path_matches_follow_the_gateway_api():
    assert haproxy_config._path_acls(PathMatch("PathPrefix", "/v1/")) == ["{ path -m str /v1 }", "{ path -m beg /v1/ }"]
    assert haproxy_config._path_acls(PathMatch("PathPrefix", "/")) == [""]
    assert haproxy_config._path_acls(PathMatch("Exact", "/v1")) == ["{ path -m str /v1 }"]
    rule = {"matches": [{"method": {"service": "s.S", "method": "M"}}], "backendRefs": [{"name": "svc", "port": 8001}]}
    route = gateway_routes.route_from_rendered({"type": gateway_routes.GRPC_ROUTE, "inputs": {
        "kind": "GRPCRoute", "metadata": {"name": "r"}, "spec": {"rules": [rule]}}})
    assert route.rules[0].matches == (PathMatch("Exact", "/s.S/M"),)
    assert route.rules[0].backends == (BackendRef("svc", 8001, 1),)


# -- the running proxy --------------------------------------------------------------------------------------------


def test_clients_trust_the_rehearsals_ca_and_only_it(running, pods, certificate, ca):
    haproxy, cfg, gw = running
    resources = [gateway_resource(), *route_resources("chat", "chat", [("chat-1-0", 100)])]
    haproxy.start(render(resources, pods["pod-a"].endpoints("chat-1-0"), cfg))
    cert = x509.load_pem_x509_certificate(certificate.cert_pem)
    issuer = x509.load_pem_x509_certificate(ca.cert_pem)
    assert cert.issuer == issuer.subject
    host = f"chat.{DOMAIN}"
    with gw.http() as client:
        answer = gw.get(client, host, "/v1/models").json()
        assert (answer["pod"], answer["path"], answer["host"]) == ("pod-a", "/v1/models", host)
        assert gw.get(client, host, "/v2/health/ready").json()["path"] == "/v2/health/ready"
        assert gw.get(client, host, "/v1x").status_code == 404  # PathPrefix is element-wise
        assert gw.get(client, f"other.{DOMAIN}", "/v1/models").status_code == 404  # no route for the host
        assert client.get(f"https://127.0.0.1:{gw.port}/v1/models", headers={"Host": host},
                          extensions={"sni_hostname": host}).http_version == "HTTP/1.1"
    with gw.http(verify=True) as system, pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        gw.get(system, host, "/v1/models")  # the machine's CAs do not know the rehearsal's
    with gw.http() as client, pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED|match"):
        gw.get(client, "chat.example.com", "/v1/models")  # a name the certificate does not cover
    with gw.channel(f"chat.grpc.{DOMAIN}") as channel:
        assert ready(channel) == "pod-a" and stream(channel) == "pod-a"
    with gw.channel(f"chat.{DOMAIN}") as channel, pytest.raises(grpc.RpcError) as err:
        ready(channel)  # gRPC on the HTTP hostname: no GRPCRoute there
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    other = CertificateAuthority.create(haproxy.workdir / "other-ca")
    with gw.channel(f"chat.grpc.{DOMAIN}", other.grpc_credentials()) as channel, pytest.raises(grpc.RpcError) as err:
        ready(channel)  # a client trusting another CA refuses the gateway
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    context = ssl.create_default_context(cafile=str(ca.ca_path))
    context.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection(("127.0.0.1", gw.port)) as raw, \
            context.wrap_socket(raw, server_hostname=f"chat.grpc.{DOMAIN}") as tls:
        assert tls.selected_alpn_protocol() == "h2"


@dataclass
class Outcome:
    kind: str
    started: int  # the phase when it was sent
    ended: int  # the phase when it came back
    pod: str | None
    error: str | None


class Load:
    """A bounded load on the proxy: one thread per kind (HTTP/1.1 GET /v1/models, gRPC ServerReady, a gRPC stream),
    each sending one request after another and recording every outcome with the phase it was sent and answered in.
    Phases are even while a configuration holds and odd while one is being applied."""

    def __init__(self, gw: Gateway, label: str):
        self.gw, self.label = gw, label
        self.phase = 0
        self.outcomes: list[Outcome] = []
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []

    def _loop(self, kind: str, open_: Callable, call: Callable) -> None:
        with open_() as conn:
            while not self.stopping.is_set():
                started = self.phase
                pod = error = None
                try:
                    pod = call(conn)
                except Exception as exc:  # every failure is recorded and fails the test
                    error = f"{type(exc).__name__}: {exc}"
                with self.cond:
                    self.outcomes.append(Outcome(kind, started, self.phase, pod, error))
                    self.cond.notify_all()
                time.sleep(0.002)

    def start(self) -> Load:
        host, grpc_host = f"{self.label}.{DOMAIN}", f"{self.label}.grpc.{DOMAIN}"
        loops = [("http", self.gw.http, lambda c: self.gw.get(c, host, "/v1/models").raise_for_status().json()["pod"]),
                 ("grpc", lambda: self.gw.channel(grpc_host), ready),
                 ("stream", lambda: self.gw.channel(grpc_host), stream)]
        for kind, open_, call in loops:
            thread = threading.Thread(target=self._loop, args=(kind, open_, call), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def settled(self, phase: int, kinds: tuple[str, ...]) -> Counter[str]:
        """Pods that answered the requests sent and answered within `phase`, of the given kinds."""
        with self.cond:
            return Counter(o.pod for o in self.outcomes if o.started == o.ended == phase and o.kind in kinds
                           and o.error is None)

    def hold(self, n: int, timeout: float = 30) -> int:
        """Wait until every kind has `n` requests sent and answered in the current phase; the phase."""
        phase = self.phase
        with self.cond:
            done = self.cond.wait_for(lambda: all(
                sum(1 for o in self.outcomes if o.kind == k and o.started == o.ended == phase) >= n
                for k in ("http", "grpc", "stream")), timeout)
        assert done, f"the load did not complete {n} requests per kind in phase {phase}: {self.failures()[:3]}"
        return phase

    def change(self, apply: Callable[[], str]) -> str:
        self.phase += 1
        how = apply()
        self.phase += 1
        return how

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(15)


def test_weights_move_under_load_through_the_runtime_api_without_a_failed_request(running, pods):
    """A red-black split moving 100/0 -> 50/50 -> 0/100 (the routes re-rendered at each weight, as each rollout
    step renders them) while the load runs: each step is a runtime weight change (no reload), the distribution of the
    requests sent after it follows the weights, and no request fails."""
    haproxy, cfg, gw = running
    endpoints = merge(pods["pod-a"].endpoints("chat-1-0"), pods["pod-b"].endpoints("chat-2-0"))

    def at(active: int) -> haproxy_config.ProxyConfig:
        return render([gateway_resource(), *route_resources("chat", "chat", [("chat-1-0", active),
                                                                             ("chat-2-0", 100 - active)])],
                      endpoints, cfg)

    haproxy.start(at(100))
    load = Load(gw, "chat").start()
    try:
        split = {}
        split[100] = load.hold(12)
        assert load.change(lambda: haproxy.apply(at(50))) == "weights"
        split[50] = load.hold(12)
        assert load.change(lambda: haproxy.apply(at(0))) == "weights"
        split[0] = load.hold(12)
        assert load.change(lambda: haproxy.apply(at(0))) == "unchanged"
    finally:
        load.stop()
    assert not load.failures(), load.failures()[:5]
    assert haproxy.reloads == 0 and haproxy.weight_updates == 2
    assert haproxy.workers()[0] and not haproxy.workers()[1]  # one worker throughout
    for kinds in (("http",), ("grpc", "stream")):  # the HTTPRoute's backend, the GRPCRoute's
        assert set(load.settled(split[100], kinds)) == {"pod-a"}
        assert set(load.settled(split[0], kinds)) == {"pod-b"}
        half = load.settled(split[50], kinds)
        assert min(half["pod-a"], half["pod-b"]) >= sum(half.values()) // 4, half


def test_pods_and_routes_change_under_load_through_seamless_reloads(running, pods):
    """Structural changes under load, each a reload of the master-worker HAProxy: the candidate's Service scales to
    two pods, a per-version hostname is added (a versioned model's route next to the red-black one), then the
    finished rollout's routes drop the old Service. Every request and every stream succeeds across the reloads; the
    requests sent after each reload (and after the old worker drained) follow the new routes."""
    haproxy, cfg, gw = running
    a, b, c = (pods[p].endpoints(s) for p, s in (("pod-a", "chat-1-0"), ("pod-b", "chat-2-0"), ("pod-c", "chat-2-0")))
    split = [("chat-1-0", 0), ("chat-2-0", 100)]
    haproxy.start(render([gateway_resource(), *route_resources("chat", "chat", split)], merge(a, b), cfg))
    load = Load(gw, "chat").start()
    try:
        first = load.hold(8)
        scaled = render([gateway_resource(), *route_resources("chat", "chat", split)], merge(a, b, c), cfg)
        assert load.change(lambda: haproxy.apply(scaled)) == "reload"
        haproxy.wait_drained()
        two_pods = load.hold(8)
        versioned = [gateway_resource(), *route_resources("chat", "chat", split),
                     *route_resources("chat-2-0", "chat-2-0", [("chat-2-0", 100)])]
        assert load.change(lambda: haproxy.apply(render(versioned, merge(a, b, c), cfg))) == "reload"
        haproxy.wait_drained()
        with gw.http() as client:  # the per-version hostname reaches that version's pods only
            answers = {gw.get(client, f"chat-2-0.{DOMAIN}", "/v2/models").json()["pod"] for _ in range(6)}
        with gw.channel(f"chat-2-0.grpc.{DOMAIN}") as channel:
            answers |= {ready(channel) for _ in range(6)}
        assert answers == {"pod-b", "pod-c"}
        load.hold(8)
        done = [gateway_resource(), *route_resources("chat", "chat", [("chat-2-0", 100)])]
        assert load.change(lambda: haproxy.apply(render(done, merge(b, c), cfg))) == "reload"
        haproxy.wait_drained()
        final = load.hold(8)
    finally:
        load.stop()
    assert not load.failures(), load.failures()[:5]
    assert haproxy.reloads == 3 and haproxy.workers()[2] == 3
    assert haproxy.runtime("show servers state grpcroute.chat-grpc.0").count("chat-1-0") == 0
    for kinds in (("http",), ("grpc", "stream")):
        assert set(load.settled(first, kinds)) == {"pod-b"}
        both = load.settled(two_pods, kinds)
        assert set(both) == {"pod-b", "pod-c"} and min(both.values()) >= sum(both.values()) // 4, both
        assert set(load.settled(final, kinds)) == {"pod-b", "pod-c"}


def test_a_configuration_haproxy_refuses_leaves_the_running_one(running, pods):
    haproxy, cfg, gw = running
    resources = [gateway_resource(), *route_resources("chat", "chat", [("chat-1-0", 100)])]
    good = render(resources, pods["pod-a"].endpoints("chat-1-0"), cfg)
    haproxy.start(good)
    broken = haproxy_config.ProxyConfig(good.text.replace("balance roundrobin", "balance nonsense"),
                                        good.skeleton + "x", good.weights, good.admin_socket)
    with pytest.raises(haproxy_process.ProxyError, match="haproxy -c refused"):
        haproxy.apply(broken)
    assert haproxy.config is good and haproxy.config_path.read_text() == good.text
    with gw.http() as client:
        assert gw.get(client, f"chat.{DOMAIN}", "/v1/models").json()["pod"] == "pod-a"
    assert subprocess.run(["haproxy", "-c", "-q", "-f", str(haproxy.config_path)]).returncode == 0


def test_a_pod_that_serves_errors_is_retried_on_another_and_the_client_sees_none(running, workdir, certificate):
    """A red-black split at 50/50 whose candidate pod answers every request with a 503 (its own pods here, so the
    module's pods stay healthy): with the Gateway's retry policy every request succeeds on the healthy pod, while
    the bad pod did get its share (each of its failures was retried elsewhere); without the policy, its share
    fails. HAProxy's round robin on one thread alternates the two servers, so both counts are exact."""
    haproxy, cfg, gw = running
    good, bad = Pod("pod-good"), Pod("pod-bad")
    bad.fail_status = 503
    try:
        endpoints = merge(good.endpoints("chat-1-0"), bad.endpoints("chat-2-0"))
        routes = [gateway_resource(), *route_resources("chat", "chat", [("chat-1-0", 50), ("chat-2-0", 50)])]
        haproxy.start(render([*routes, retry_policy_resource()], endpoints, cfg))
        body = {"model": "chat", "prompt": "x" * 2000, "max_tokens": 4}  # a POST with a body, as clients send
        with gw.http() as client:
            answers = [client.post(f"https://127.0.0.1:{gw.port}/v1/completions", json=body,
                                   headers={"Host": f"chat.{DOMAIN}"}, extensions={"sni_hostname": f"chat.{DOMAIN}"})
                       for _ in range(10)]
        assert [a.status_code for a in answers] == [200] * 10
        assert {a.json()["pod"] for a in answers} == {"pod-good"}
        assert good.counts["http"] == 10 and bad.counts["http-failed"] >= 4, (good.counts, bad.counts)
        assert haproxy.apply(render(routes, endpoints, cfg)) == "reload"  # the policy removed
        haproxy.wait_drained()
        with gw.http() as client:
            statuses = [client.post(f"https://127.0.0.1:{gw.port}/v1/completions", json=body,
                                    headers={"Host": f"chat.{DOMAIN}"},
                                    extensions={"sni_hostname": f"chat.{DOMAIN}"}).status_code for _ in range(10)]
        assert statuses.count(503) >= 4 and statuses.count(200) >= 4, statuses
    finally:
        good.close()
        bad.close()
