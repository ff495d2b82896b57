"""The rendered Gateway API objects as typed values: the Gateway's listeners, its HTTPRoutes and GRPCRoutes, and
the Ready pods behind a Service's ports, as the rehearsal's gateway realises them (docs/rehearsal.md,
"Rollouts under load"; haproxy_config.py turns them into HAProxy's configuration).

    rendered Gateway, HTTPRoutes, GRPCRoutes  --gateway_from_rendered/routes_from_rendered-->  Gateway, Route
    a rendered Service + its Ready pods       --endpoints_for_service-->                        Endpoints

The objects are read as render.Rendered holds them (`{type, name, inputs}`). What the gateway does not realise is
refused here by name (ProxyConfigError) rather than approximated: a listener protocol other than HTTP/HTTPS, TLS other
than Terminate, header, query or method matches, filters, non-Service backends. A GRPCRoute method match becomes the
path match it is on the wire (`/<service>/`, or `/<service>/<method>`), so that the configuration knows paths only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GATEWAY = "kubernetes:gateway.networking.k8s.io/v1:Gateway"
HTTP_ROUTE = "kubernetes:gateway.networking.k8s.io/v1:HTTPRoute"
GRPC_ROUTE = "kubernetes:gateway.networking.k8s.io/v1:GRPCRoute"


class ProxyConfigError(ValueError):
    """The rendered objects ask for something this translation does not realise (named, never approximated)."""


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


# A resource as render.Rendered holds it (`{type, name, inputs}`) or the bare object; gateway_retry.py reads the
# BackendTrafficPolicy through these too.
def resource_spec(resource: Mapping[str, Any]) -> dict[str, Any]:
    return (resource.get("inputs") or resource).get("spec") or {}


def resource_name(resource: Mapping[str, Any]) -> str:
    inputs = resource.get("inputs") or resource
    return (inputs.get("metadata") or {}).get("name") or resource.get("name") or "?"


def gateway_from_rendered(resources: Iterable[Mapping[str, Any]], name: str | None = None) -> Gateway:
    """The Gateway the program renders (`{type, name, inputs}` as render.Rendered holds them), or the one named."""
    gateways = [r for r in resources if r.get("type") == GATEWAY and (name is None or resource_name(r) == name)]
    if len(gateways) != 1:
        raise ProxyConfigError(f"expected one Gateway{f' named {name}' if name else ''}, found {len(gateways)}")
    (gw,) = gateways
    listeners = []
    for li in resource_spec(gw).get("listeners") or []:
        protocol = li.get("protocol", "HTTP")
        if protocol not in ("HTTP", "HTTPS"):
            raise ProxyConfigError(f"listener {li.get('name')}: protocol {protocol} is not realised (HTTP, HTTPS)")
        if protocol == "HTTPS" and (li.get("tls") or {}).get("mode", "Terminate") != "Terminate":
            raise ProxyConfigError(f"listener {li.get('name')}: only TLS mode Terminate is realised")
        listeners.append(Listener(li["name"], int(li["port"]), protocol, li.get("hostname")))
    return Gateway(resource_name(gw), tuple(listeners))


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
    name = resource_name(resource)
    spec = resource_spec(resource)
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
