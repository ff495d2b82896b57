"""The Gateway API routes realised by a real proxy: Debian's HAProxy 2.6 (issue 17, docs/rehearsal.md, "The
gateway"). Envoy Gateway, the program's data plane (infra/bootstrap.py), is not packaged for Debian.

    rendered Gateway, HTTPRoutes, GRPCRoutes  --gateway_from_rendered/routes_from_rendered-->  Gateway, Route
    + the Ready pods' addresses per (Service, port)                          --render_config-->  ProxyConfig
    ProxyConfig                                        --HAProxy.start / HAProxy.apply-->  a running haproxy -W

How the objects map:

- **Listeners.** One frontend per listener port; an HTTPS listener is `bind ... ssl crt <pem> alpn h2,http/1.1`
  (TLS terminated with the rehearsal's certificate, tls.py), so HTTP/1.1 and gRPC (HTTP/2) share it as they share
  Envoy's. The two listeners the program declares on 443 (`*.<domain>` for HTTPRoutes, `*.grpc.<domain>` for
  GRPCRoutes) become one frontend: they differ only by hostname, and routing is by hostname.
- **Routes.** A route attaches to its listener by `parentRefs[].sectionName`; its hostnames must fall under the
  listener's (Gateway API semantics: `*.d` matches any name ending in `.d`), or the route is refused. Each rule is a
  `use_backend` on `Host`/`:authority` (port stripped, lower-cased) and the rule's matches: an HTTPRoute path match
  (`PathPrefix` element-wise as the Gateway API defines it, `Exact`), a GRPCRoute method match as the path
  `/<service>/` (or `/<service>/<method>`). Rules are ordered by the Gateway API's precedence (exact hostnames before
  wildcards, exact paths before prefixes, longer prefixes first). Anything else (header, query or method matches,
  filters, non-Service backends) is refused by name rather than approximated. No rule matching: 404.
- **backendRefs and weights.** A rule is one HAProxy backend, `balance roundrobin` (smooth weighted round robin,
  each request or gRPC stream balanced on its own), whose servers are the Ready pods behind each backendRef's
  (Service, port). A backendRef's weight is shared by its pods as kube-proxy shares a Service's connections, so a
  server's weight is `weight / pods`, scaled to HAProxy's integer range 1..256 (0 stays 0). A backendRef with
  weight but no Ready pod keeps its share and fails it, as Envoy answers "no healthy upstream" for a weighted
  cluster without endpoints: its share goes to a server on a refused address (`Settings.unreachable`), 503.
  GRPCRoute backends are HTTP/2 cleartext (`proto h2`, the Service's `appProtocol: kubernetes.io/h2c`), HTTPRoute
  backends HTTP/1.1.

Applying a change (`HAProxy.apply`), without dropping a connection:

- **Only weights changed** (a red-black step: same backends, same pods): the runtime API, `set server <backend>/
  <server> weight <w>` over the admin socket, raises before it lowers, so no backend is ever without weight. The
  process, its connections and its listening sockets stay; the next request (or gRPC stream, even on an open HTTP/2
  connection) is balanced by the new weights. A reload would instead leave every open connection on the old worker,
  with the old weights, until it is closed.
- **Anything else** (a pod Ready or gone, a backendRef or a route added or removed): a seamless reload of HAProxy's
  master-worker mode (`haproxy -W`, SIGUSR2 to the master). The new configuration is checked first (`haproxy -c`);
  the new worker receives the listening sockets from the old one (the same socket, so no connection is refused
  and none waiting in its accept queue is lost); the old worker finishes what it serves and leaves (HTTP/2 clients
  get a GOAWAY and move to the new worker), bounded by `hard-stop-after`. An idle HTTP/1.1 keep-alive connection
  would be closed by the old worker at the moment a client may be sending on it (HAProxy 2.6 has no
  `idle-close-on-response`), so HTTP/1.1 client connections carry one request each (`Connection: close`): the
  reload is the rehearsal's artifact (Envoy takes route and endpoint changes over xDS without draining), and this
  keeps it from failing requests that production would not fail. gRPC (HTTP/2) connections are kept alive.

Retries (the Gateway's BackendTrafficPolicy, `retry_from_rendered`): Envoy Gateway's `retry` becomes, in every
backend, `retries <numRetries>`, `retry-on` with HAProxy's names for the triggers (`connect-failure` -> conn-failure,
`reset` -> empty-response (the pod closed or reset the connection without an answer), `retriable-status-codes` ->
the `httpStatusCodes`, `5xx`, `gateway-error`) and `option redispatch 1`, so that every retry goes to another server
when there is one, as Envoy Gateway's retry policy does (its `previous_hosts` predicate), and `option
http-buffer-request` (HAProxy retries only a request it holds whole, so it reads the body before choosing a server;
Envoy buffers a request for its retries too). HAProxy retries only before any byte of the answer went to the client,
as Envoy does. What HAProxy cannot do is refused by name: gRPC-status
triggers (the status comes in trailers, after the answer began), `retriable-4xx`, `refused-stream`,
`reset-before-request`, status codes outside HAProxy's `retry-on` list, a per-retry timeout or back-off. A policy's
`timeout` section (idle connection timeouts, pod_contract.py) is connection management, which HAProxy does its own
way here (`timeout server`, one request per HTTP/1.1 client connection): read, not realised. Without a policy a
failed attempt is the client's failure (`retries 0`), as with Envoy's default route.

The runtime API alone cannot add a backend or a `use_backend` rule, and its `add server`/`del server` refuse a server
that still holds idle connections (HTTP/2 backends always do), hence the reload for structural changes.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GATEWAY = "kubernetes:gateway.networking.k8s.io/v1:Gateway"
HTTP_ROUTE = "kubernetes:gateway.networking.k8s.io/v1:HTTPRoute"
GRPC_ROUTE = "kubernetes:gateway.networking.k8s.io/v1:GRPCRoute"
BACKEND_TRAFFIC_POLICY = "kubernetes:gateway.envoyproxy.io/v1alpha1:BackendTrafficPolicy"
MAX_WEIGHT = 256  # HAProxy's largest server weight
_W = "\x00W:{}\x00"  # a weight's placeholder in the skeleton


class ProxyConfigError(ValueError):
    """The rendered objects ask for something this translation does not realise (named, never approximated)."""


class ProxyError(RuntimeError):
    """HAProxy refused a configuration, did not start, or did not reload."""


# -- the boundary: what comes in ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listener:
    name: str
    port: int
    protocol: str  # HTTPS (TLS terminated here) or HTTP
    hostname: str | None = None  # None: any


@dataclass(frozen=True)
class Gateway:
    name: str
    listeners: tuple[Listener, ...]

    def listener(self, section: str | None) -> list[Listener]:
        return [li for li in self.listeners if section is None or li.name == section]


@dataclass(frozen=True)
class BackendRef:
    service: str
    port: int
    weight: int = 1


@dataclass(frozen=True)
class PathMatch:
    type: str  # Exact or PathPrefix
    value: str


@dataclass(frozen=True)
class Rule:
    matches: tuple[PathMatch, ...]  # empty: every path
    backends: tuple[BackendRef, ...]


@dataclass(frozen=True)
class Route:
    kind: str  # HTTPRoute or GRPCRoute
    name: str
    hostnames: tuple[str, ...]
    sections: tuple[str | None, ...]  # the Gateway listeners it attaches to (None: every listener)
    rules: tuple[Rule, ...]

    @property
    def grpc(self) -> bool:
        return self.kind == "GRPCRoute"


@dataclass(frozen=True)
class Endpoint:
    """One Ready pod behind a Service port: where the proxy sends that port's requests."""

    pod: str
    address: str
    port: int


Endpoints = Mapping[tuple[str, int], Sequence[Endpoint]]  # (Service name, Service port) -> its Ready pods


@dataclass(frozen=True)
class Settings:
    binds: Mapping[int, tuple[str, int]]  # listener port -> (address, port) this proxy listens on
    admin_socket: Path  # the runtime API (level admin, mode 0600)
    certificate: Path | None = None  # certificate chain and key (tls.ServerCertificate.pem_path) for HTTPS
    threads: int = 1  # one thread: round robin is one sequence, so a distribution is exact
    hard_stop_after_s: int = 120  # the longest an old worker keeps serving after a reload
    timeout_client_s: int = 300
    timeout_server_s: int = 300  # a generation may stream for minutes
    timeout_connect_s: int = 5
    unreachable: str = "127.0.0.1:1"  # where a backendRef without Ready pods sends its share (refused: 503)
    access_log: bool = True  # one line per request on HAProxy's stdout


# -- from the rendered objects -------------------------------------------------------------------------------


def _spec(resource: Mapping[str, Any]) -> dict[str, Any]:
    return (resource.get("inputs") or resource).get("spec") or {}


def _meta_name(resource: Mapping[str, Any]) -> str:
    inputs = resource.get("inputs") or resource
    return (inputs.get("metadata") or {}).get("name") or resource.get("name") or "?"


def gateway_from_rendered(resources: Iterable[Mapping[str, Any]], name: str | None = None) -> Gateway:
    """The Gateway the program renders (`{type, name, inputs}` as render.Rendered holds them), or the one named."""
    gateways = [r for r in resources if r.get("type") == GATEWAY and (name is None or _meta_name(r) == name)]
    if len(gateways) != 1:
        raise ProxyConfigError(f"expected one Gateway{f' named {name}' if name else ''}, found {len(gateways)}")
    (gw,) = gateways
    listeners = []
    for li in _spec(gw).get("listeners") or []:
        protocol = li.get("protocol", "HTTP")
        if protocol not in ("HTTP", "HTTPS"):
            raise ProxyConfigError(f"listener {li.get('name')}: protocol {protocol} is not realised (HTTP, HTTPS)")
        if protocol == "HTTPS" and (li.get("tls") or {}).get("mode", "Terminate") != "Terminate":
            raise ProxyConfigError(f"listener {li.get('name')}: only TLS mode Terminate is realised")
        listeners.append(Listener(li["name"], int(li["port"]), protocol, li.get("hostname")))
    return Gateway(_meta_name(gw), tuple(listeners))


def _path_match(route: str, match: Mapping[str, Any], grpc: bool) -> PathMatch:
    extra = sorted(set(match) - {"method" if grpc else "path"})
    if extra:
        raise ProxyConfigError(f"route {route}: {'/'.join(extra)} matches are not realised (only "
                               f"{'method' if grpc else 'path'} matches)")
    if grpc:
        method = match.get("method") or {}
        if method.get("type", "Exact") != "Exact":
            raise ProxyConfigError(f"route {route}: gRPC method match type {method['type']} is not realised")
        service, name = method.get("service"), method.get("method")
        if not service:
            raise ProxyConfigError(f"route {route}: a gRPC method match without a service is not realised")
        return PathMatch("Exact", f"/{service}/{name}") if name else PathMatch("PathPrefix", f"/{service}")
    path = match.get("path") or {}
    kind, value = path.get("type", "PathPrefix"), path.get("value", "/")
    if kind not in ("PathPrefix", "Exact"):
        raise ProxyConfigError(f"route {route}: path match type {kind} is not realised (PathPrefix, Exact)")
    return PathMatch(kind, value)


def route_from_rendered(resource: Mapping[str, Any]) -> Route:
    inputs = resource.get("inputs") or resource
    kind = inputs.get("kind") or ("GRPCRoute" if resource.get("type") == GRPC_ROUTE else "HTTPRoute")
    name = _meta_name(resource)
    spec = _spec(resource)
    grpc = kind == "GRPCRoute"
    rules = []
    for rule in spec.get("rules") or []:
        if rule.get("filters"):
            raise ProxyConfigError(f"route {name}: filters are not realised")
        refs = []
        for ref in rule.get("backendRefs") or []:
            if ref.get("kind", "Service") != "Service" or ref.get("group", "") not in ("", "core"):
                raise ProxyConfigError(f"route {name}: backendRef {ref.get('name')} is not a Service")
            if ref.get("filters"):
                raise ProxyConfigError(f"route {name}: backendRef filters are not realised")
            if "port" not in ref:
                raise ProxyConfigError(f"route {name}: backendRef {ref.get('name')} has no port")
            refs.append(BackendRef(ref["name"], int(ref["port"]), int(ref.get("weight", 1))))
        matches = tuple(_path_match(name, m, grpc) for m in rule.get("matches") or [])
        rules.append(Rule(matches, tuple(refs)))
    sections = tuple(p.get("sectionName") for p in spec.get("parentRefs") or []) or (None,)
    return Route(kind, name, tuple(spec.get("hostnames") or ()), sections, tuple(rules))


def routes_from_rendered(resources: Iterable[Mapping[str, Any]]) -> list[Route]:
    return [route_from_rendered(r) for r in resources if r.get("type") in (HTTP_ROUTE, GRPC_ROUTE)]


@dataclass(frozen=True)
class RetryPolicy:
    """A Gateway-wide retry policy, in HAProxy's terms."""

    retries: int
    retry_on: tuple[str, ...]  # HAProxy's `retry-on` keywords and status codes
    source: str  # the BackendTrafficPolicy it comes from


ENVOY_DEFAULT_RETRIES = 2  # Envoy Gateway's numRetries when the policy gives none
_HAPROXY_RETRY_STATUSES = frozenset({401, 403, 404, 408, 425, 500, 501, 502, 503, 504})  # what `retry-on` accepts
_TRIGGER_STATUSES = {"5xx": (500, 501, 502, 503, 504), "gateway-error": (502, 503, 504)}
_TRIGGER_KEYWORDS = {"connect-failure": ("conn-failure",), "reset": ("empty-response",)}
_POLICY_KEYS = {"targetRefs", "targetRef", "retry", "timeout"}


def retry_from_rendered(resources: Iterable[Mapping[str, Any]], gateway: Gateway) -> RetryPolicy | None:
    """The retry policy of the BackendTrafficPolicy attached to `gateway` (None when there is none, or it has no
    `retry`); a policy attached to anything else, or asking for what HAProxy cannot do, is refused by name."""
    found: list[RetryPolicy] = []
    for resource in resources:
        if resource.get("type") != BACKEND_TRAFFIC_POLICY:
            continue
        name = _meta_name(resource)
        spec = _spec(resource)
        extra = sorted(set(spec) - _POLICY_KEYS)
        if extra:
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: {', '.join(extra)} not realised (retry only)")
        targets = spec.get("targetRefs") or ([spec["targetRef"]] if spec.get("targetRef") else [])
        if not targets or any(t.get("kind") != "Gateway" or t.get("name") != gateway.name for t in targets):
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: only a policy attached to Gateway {gateway.name} "
                                   f"is realised (targets {[(t.get('kind'), t.get('name')) for t in targets]})")
        retry = spec.get("retry")
        if retry is None:
            continue
        unknown = sorted(set(retry) - {"numRetries", "retryOn"})
        if unknown:
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: retry.{', retry.'.join(unknown)} not realised "
                                   "(HAProxy has no per-retry timeout or back-off)")
        retry_on = retry.get("retryOn") or {}
        triggers = list(retry_on.get("triggers") or [])
        statuses = [int(c) for c in retry_on.get("httpStatusCodes") or []]
        keywords: list[str] = []
        for trigger in triggers:
            if trigger in _TRIGGER_KEYWORDS:
                keywords += _TRIGGER_KEYWORDS[trigger]
            elif trigger in _TRIGGER_STATUSES:
                statuses += _TRIGGER_STATUSES[trigger]
            elif trigger != "retriable-status-codes":
                raise ProxyConfigError(f"BackendTrafficPolicy {name}: retry trigger {trigger!r} is not realised "
                                       "(connect-failure, reset, retriable-status-codes, 5xx, gateway-error)")
        if statuses and "retriable-status-codes" not in triggers and not set(triggers) & set(_TRIGGER_STATUSES):
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: httpStatusCodes without the "
                                   "retriable-status-codes trigger retry nothing in Envoy; refused as a likely mistake")
        if "retriable-status-codes" in triggers and not retry_on.get("httpStatusCodes"):
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: retriable-status-codes without httpStatusCodes")
        refused = sorted(set(statuses) - _HAPROXY_RETRY_STATUSES)
        if refused:
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: HAProxy cannot retry on status {refused} "
                                   f"(it can on {sorted(_HAPROXY_RETRY_STATUSES)})")
        if not keywords and not statuses:
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: a retry policy without a trigger")
        count = int(retry.get("numRetries", ENVOY_DEFAULT_RETRIES))
        if count < 0:
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: numRetries {count} is negative")
        ordered = tuple(dict.fromkeys(keywords)) + tuple(str(c) for c in sorted(set(statuses)))
        found.append(RetryPolicy(count, ordered, name))
    if len(found) > 1:
        raise ProxyConfigError(f"Gateway {gateway.name}: {len(found)} BackendTrafficPolicies with a retry "
                               f"({', '.join(p.source for p in found)}); Envoy Gateway would take the oldest")
    return found[0] if found else None


def endpoints_for_service(service: Mapping[str, Any], pods: Iterable[Any]) -> dict[tuple[str, int], list[Endpoint]]:
    """A rendered Service's ports -> its Ready pods' addresses. `pods`: objects with `pod`, `address` and `ports`
    (container port numbers by name), as services.Endpoint; a named targetPort is resolved per pod."""
    inputs = service.get("inputs") or service
    name = inputs["metadata"]["name"]
    out: dict[tuple[str, int], list[Endpoint]] = {}
    pods = list(pods)
    for port in inputs["spec"].get("ports") or []:
        target = port.get("targetPort", port["port"])
        found = []
        for pod in pods:
            number = pod.ports.get(target) if isinstance(target, str) else int(target)
            if number is not None:
                found.append(Endpoint(pod.pod, pod.address, int(number)))
        out[(name, int(port["port"]))] = found
    return out


# -- the configuration -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProxyConfig:
    """What render_config produces: the configuration text, and what apply needs to change weights in place."""

    text: str
    skeleton: str  # the text with every server weight left out: equal skeletons differ only in weights
    weights: dict[tuple[str, str], int]  # (HAProxy backend, server) -> weight
    admin_socket: Path
    backends: dict[str, dict[str, int]] = field(default_factory=dict)  # HAProxy backend -> Service -> route weight


def _ident(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", text)


def _host_matches(listener: str | None, host: str) -> bool:
    if listener is None:
        return True
    if listener.startswith("*."):
        suffix = listener[1:]
        if host.startswith("*."):
            return host[1:].endswith(suffix)
        return host.endswith(suffix) and len(host) > len(suffix)
    return host == listener


def _host_acl(host: str) -> str:
    fetch = "req.hdr(host),host_only,lower"
    if host.startswith("*."):
        return f"{{ {fetch} -m end {host[1:].lower()} }}"
    return f"{{ {fetch} -m str {host.lower()} }}"


def _path_acls(match: PathMatch) -> list[str]:
    if match.type == "Exact":
        return [f"{{ path -m str {match.value} }}"]
    value = match.value.rstrip("/")
    if not value:
        return [""]  # every path
    return [f"{{ path -m str {value} }}", f"{{ path -m beg {value}/ }}"]


def _precedence(host: str, match: PathMatch | None) -> tuple:
    wildcard = host.startswith("*.")
    if match is None:
        return (wildcard, -len(host), 2, 0)
    return (wildcard, -len(host), 0 if match.type == "Exact" else 1, -len(match.value.rstrip("/")))


def server_weights(shares: Sequence[tuple[int, int]]) -> list[int]:
    """Per-server weights for backendRefs given as (route weight, Ready pods): each pod of a ref gets weight/pods,
    as integers in 1..MAX_WEIGHT in the same proportions (rounded when they do not fit; never 0 for a share > 0)."""
    live = [(w, n) for w, n in shares if w > 0 and n > 0]
    if not live:
        return [0] * len(shares)
    lcm = math.lcm(*(n for _, n in live))
    raw = [w * lcm // n if w > 0 and n > 0 else 0 for w, n in shares]
    divisor = math.gcd(*(r for r in raw if r))
    raw = [r // divisor for r in raw]
    top = max(raw)
    if top <= MAX_WEIGHT:
        return raw
    return [max(1, round(r * MAX_WEIGHT / top)) if r else 0 for r in raw]


def render_config(gateway: Gateway, routes: Sequence[Route], endpoints: Endpoints, settings: Settings,
                  retry: RetryPolicy | None = None) -> ProxyConfig:
    """HAProxy's configuration for `routes` on `gateway`, the backends being the pods in `endpoints`; with `retry`,
    a failed attempt is retried on another pod (the module's "Retries")."""
    by_port: dict[int, list[Listener]] = {}
    for li in gateway.listeners:
        by_port.setdefault(li.port, []).append(li)
    rules_by_port: dict[int, list[tuple[tuple, str, str]]] = {p: [] for p in by_port}  # (precedence, acl, backend)
    backends: list[str] = []
    weights: dict[tuple[str, str], int] = {}
    shares: dict[str, dict[str, int]] = {}
    used_names: set[str] = set()
    for route in routes:
        listeners = [li for s in route.sections for li in gateway.listener(s)]
        if not listeners:
            raise ProxyConfigError(f"route {route.name}: no listener {route.sections} on Gateway {gateway.name}")
        for li in listeners:
            hosts = route.hostnames or ((li.hostname,) if li.hostname else ())
            refused = [h for h in hosts if not _host_matches(li.hostname, h)]
            if refused:
                raise ProxyConfigError(f"route {route.name}: hostname(s) {refused} are not under listener "
                                       f"{li.name}'s {li.hostname}")
            for i, rule in enumerate(route.rules):
                backend = _ident(f"{route.kind.lower()}.{route.name}.{i}")
                if backend not in used_names:
                    used_names.add(backend)
                    lines, rule_weights = _backend(backend, route, rule, endpoints, settings, retry)
                    backends.append(lines)
                    weights.update(rule_weights)
                    shares[backend] = {ref.service: ref.weight for ref in rule.backends}
                for host in hosts or ("",):
                    host_acl = _host_acl(host) if host else ""
                    for match in rule.matches or (None,):
                        paths = _path_acls(match) if match else [""]
                        acl = " || ".join(" ".join(filter(None, (host_acl, p))) or "TRUE" for p in paths)
                        rules_by_port[li.port].append((_precedence(host or "*.", match), acl, backend))

    out = ["# Rendered by llm_serving_cli/rehearsal/proxy.py from the Gateway API objects; do not edit.",
           "global",
           f"    nbthread {settings.threads}",
           f"    hard-stop-after {settings.hard_stop_after_s}s",
           f"    stats socket {settings.admin_socket} mode 600 level admin expose-fd listeners",
           "    ssl-default-bind-options ssl-min-ver TLSv1.2",
           *(["    log stdout format raw local0 info"] if settings.access_log else []),
           "",
           "defaults",
           "    mode http",
           *(["    log global", "    option httplog"] if settings.access_log else []),
           "    option forwardfor",
           "    retries 0  # without a retry policy a failed attempt is the client's failure, as with Envoy's",
           f"    timeout connect {settings.timeout_connect_s}s",
           f"    timeout client {settings.timeout_client_s}s",
           f"    timeout server {settings.timeout_server_s}s",
           "    timeout http-request 30s",
           "    timeout client-fin 5s",
           ""]
    for port, listeners in sorted(by_port.items()):
        if port not in settings.binds:
            raise ProxyConfigError(f"listener port {port} ({', '.join(li.name for li in listeners)}) has no bind "
                                   "address in the settings")
        address, bind_port = settings.binds[port]
        tls = any(li.protocol == "HTTPS" for li in listeners)
        if tls and any(li.protocol != "HTTPS" for li in listeners):
            raise ProxyConfigError(f"listener port {port} mixes HTTP and HTTPS listeners")
        if tls and settings.certificate is None:
            raise ProxyConfigError(f"listener port {port} is HTTPS: the settings need a certificate")
        bind = f"    bind {address}:{bind_port}"
        if tls:
            bind += f" ssl crt {settings.certificate} alpn h2,http/1.1"
        out += [f"frontend gateway.{port}  # listeners {', '.join(li.name for li in listeners)}", bind,
                "    http-request set-header X-Forwarded-Proto https" if tls else "",
                "    # HTTP/1.1: one request per connection, so that a reload never closes an idle one under a client",
                "    http-after-response set-header Connection close if !{ req.ver 2.0 }"]
        for _, acl, backend in sorted(rules_by_port[port], key=lambda r: r[0]):
            out.append(f"    use_backend {backend} if {acl}" if acl != "TRUE" else f"    use_backend {backend}")
        out += ["    default_backend no-route", ""]
    out += ["backend no-route",
            '    http-request return status 404 content-type text/plain string "no route for this host and path"',
            ""]
    out += backends
    skeleton = "\n".join(line for line in out if line != "") + "\n"
    text = skeleton
    for (backend, server), weight in weights.items():
        text = text.replace(_W.format(f"{backend}/{server}"), str(weight))
    skeleton = re.sub(r"\x00W:[^\x00]*\x00", "?", skeleton)
    return ProxyConfig(text, skeleton, weights, settings.admin_socket, shares)


def _backend(name: str, route: Route, rule: Rule, endpoints: Endpoints, settings: Settings,
             retry: RetryPolicy | None) -> tuple[str, dict[tuple[str, str], int]]:
    proto = " proto h2" if route.grpc else ""
    servers: list[tuple[str, str, int]] = []  # (server name, address:port, ref index)
    shares = []
    for k, ref in enumerate(rule.backends):
        pods = list(endpoints.get((ref.service, ref.port), ()))
        shares.append((ref.weight, max(len(pods), 1)))
        if not pods:
            servers.append((_ident(f"{ref.service}.no-ready-endpoints"), settings.unreachable, k))
        for pod in pods:
            servers.append((_ident(f"{ref.service}.{pod.pod}.{pod.port}"), f"{pod.address}:{pod.port}", k))
    per_ref = server_weights(shares)
    lines = [f"backend {name}  # route {route.name}", "    balance roundrobin"]
    if retry is not None:
        lines += [f"    retries {retry.retries}  # BackendTrafficPolicy {retry.source}",
                  f"    retry-on {' '.join(retry.retry_on)}",
                  "    option redispatch 1  # every retry on another server, when there is one",
                  # HAProxy retries only a request it holds whole: the body is read before a server is chosen
                  "    option http-buffer-request"]
    weights = {}
    seen: set[str] = set()
    for server, address, k in servers:
        while server in seen:
            server += "_"
        seen.add(server)
        weights[(name, server)] = per_ref[k]
        lines.append(f"    server {server} {address} weight {_W.format(f'{name}/{server}')}{proto}")
    return "\n".join(lines) + "\n", weights


# -- the process -----------------------------------------------------------------------------------------------


def _unix_command(path: Path, command: str, timeout: float = 5.0) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(command.encode() + b"\n")
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while data := s.recv(65536):
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


@dataclass
class HAProxy:
    """One HAProxy in master-worker mode (`haproxy -W -db -S <master socket> -f <config>`), its files in `workdir`."""

    workdir: Path
    binary: str = "haproxy"
    process: subprocess.Popen | None = None
    config: ProxyConfig | None = None
    reloads: int = 0
    weight_updates: int = 0

    @property
    def config_path(self) -> Path:
        return self.workdir / "haproxy.cfg"

    @property
    def master_socket(self) -> Path:
        return self.workdir / "master.sock"

    @property
    def log_path(self) -> Path:
        return self.workdir / "haproxy.log"

    def check(self, text: str) -> None:
        candidate = self.workdir / "haproxy.cfg.new"
        candidate.write_text(text)
        proc = subprocess.run([self.binary, "-c", "-q", "-f", str(candidate)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ProxyError(f"haproxy -c refused the configuration ({candidate}):\n{(proc.stderr or proc.stdout)}")

    def _install(self, config: ProxyConfig) -> None:
        self.check(config.text)
        (self.workdir / "haproxy.cfg.new").replace(self.config_path)

    def start(self, config: ProxyConfig, timeout: float = 15) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._install(config)
        for path in (self.master_socket, config.admin_socket):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                [self.binary, "-W", "-db", "-S", f"{self.master_socket},mode,600", "-f", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.config = config
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise ProxyError(f"haproxy exited with {self.process.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError):
                workers = self.workers()[0]
                if workers and self._admin_pid() in workers:
                    return
            if time.monotonic() > deadline:
                raise ProxyError(f"haproxy not up within {timeout}s: {self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def runtime(self, command: str) -> str:
        """A runtime API command on the current worker (the admin socket)."""
        if self.config is None:
            raise ProxyError("haproxy is not started")
        return _unix_command(self.config.admin_socket, command)

    def master(self, command: str) -> str:
        return _unix_command(self.master_socket, command)

    def _admin_pid(self) -> int | None:
        for line in self.runtime("show info").splitlines():
            if line.startswith("Pid:"):
                return int(line.split(":", 1)[1])
        return None

    def workers(self) -> tuple[list[int], list[int], int, int]:
        """(current worker pids, old worker pids still draining, reloads, failed reloads) from the master."""
        current: list[int] = []
        old: list[int] = []
        reloads = failed = 0
        section = None
        for line in self.master("show proc").splitlines():
            if line.startswith("# workers"):
                section = current
            elif line.startswith("# old workers"):
                section = old
            elif line.startswith("#"):
                section = None
            elif line.split()[1:2] == ["master"]:
                found = re.search(r"\s(\d+) \[failed: (\d+)\]", line)
                if found:
                    reloads, failed = int(found.group(1)), int(found.group(2))
            elif section is not None and line.strip():
                section.append(int(line.split()[0]))
        return current, old, reloads, failed

    def apply(self, config: ProxyConfig, timeout: float = 15) -> str:
        """Make `config` the running one: "unchanged", "weights" (the runtime API) or "reload" (see the module)."""
        if self.config is None or self.process is None:
            raise ProxyError("haproxy is not started")
        if config.text == self.config.text:
            return "unchanged"
        if config.skeleton == self.config.skeleton and config.admin_socket == self.config.admin_socket:
            self._set_weights(config)
            return "weights"
        self.reload(config, timeout)
        return "reload"

    def _set_weights(self, config: ProxyConfig) -> None:
        assert self.config is not None
        changed = [(key, w) for key, w in config.weights.items() if self.config.weights.get(key) != w]
        old = self.config.weights
        # raise first, lower last: a backend never has all its servers at weight 0 in between
        changed.sort(key=lambda kw: kw[1] <= old.get(kw[0], 0))
        self._install(config)  # a later reload (or a restart) keeps these weights
        for (backend, server), weight in changed:
            answer = self.runtime(f"set server {backend}/{server} weight {weight}").strip()
            if answer:
                raise ProxyError(f"set server {backend}/{server} weight {weight}: {answer}")
        self.config = config
        self.weight_updates += 1

    def reload(self, config: ProxyConfig, timeout: float = 15) -> None:
        assert self.process is not None
        self._install(config)
        before, _, reloads, failed = self.workers()
        os.kill(self.process.pid, signal.SIGUSR2)
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError, IndexError):
                current, _, now_reloads, now_failed = self.workers()
                if now_failed > failed:
                    raise ProxyError(f"haproxy's reload failed: {self.log_tail()}")
                if now_reloads > reloads and current and not set(current) & set(before):
                    self.config = config
                    if self._admin_pid() in current:  # the admin socket is the new worker's
                        self.reloads += 1
                        return
            if self.process.poll() is not None:
                raise ProxyError(f"haproxy exited with {self.process.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise ProxyError(f"haproxy did not reload within {timeout}s: {self.log_tail()}")
            time.sleep(0.05)

    def wait_drained(self, timeout: float = 30) -> None:
        """Until no old worker is left: every connection the previous configuration accepted has ended (an HTTP/2
        client's after its GOAWAY), so every request from now on is routed by the current configuration."""
        deadline = time.monotonic() + timeout
        while self.workers()[1]:
            if time.monotonic() > deadline:
                raise ProxyError(f"old workers {self.workers()[1]} still serve after {timeout}s")
            time.sleep(0.05)

    def stop(self, timeout: float = 10) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()  # the master stops its workers
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
