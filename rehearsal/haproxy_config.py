"""The Gateway API routes as the configuration of a real proxy: Debian's HAProxy 2.6 (docs/rehearsal.md,
"The gateway"). Envoy Gateway, the program's data plane (infra/bootstrap.py), is not packaged for Debian. Pure: text
in, text out; haproxy_process.py runs what this renders.

    Gateway, Routes (gateway_routes.py) + Endpoints + RetryPolicy (gateway_retry.py) + Settings
        --render_config-->  ProxyConfig (the text, and the weights apart from it)

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
  wildcards, exact paths before prefixes, longer prefixes first). No rule matching: 404.
- **backendRefs and weights.** A rule is one HAProxy backend, `balance roundrobin` (smooth weighted round robin,
  each request or gRPC stream balanced on its own), whose servers are the Ready pods behind each backendRef's
  (Service, port). A backendRef's weight is shared by its pods as kube-proxy shares a Service's connections, so a
  server's weight is `weight / pods`, scaled to HAProxy's integer range 1..256 (0 stays 0). A backendRef with
  weight but no Ready pod keeps its share and fails it, as Envoy answers "no healthy upstream" for a weighted
  cluster without endpoints: its share goes to a server on a refused address (`Settings.unreachable`), 503.
  GRPCRoute backends are HTTP/2 cleartext (`proto h2`, the Service's `appProtocol: kubernetes.io/h2c`), HTTPRoute
  backends HTTP/1.1.
- **Weights apart.** ProxyConfig keeps a skeleton (the text without the server weights) beside the weights, so that
  haproxy_process.py can tell a change of weights alone (the runtime API) from any other (a reload).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rehearsal.gateway_retry import RetryPolicy
from rehearsal.gateway_routes import (
    Endpoints,
    Gateway,
    Listener,
    PathMatch,
    ProxyConfigError,
    Route,
    Rule,
)

MAX_WEIGHT = 256  # HAProxy's largest server weight
_W = "\x00W:{}\x00"  # a weight's placeholder in the skeleton


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
    # Caller authentication (the rendered SecurityPolicy's apiKeyAuth, gateway.py): a file of the accepted
    # `Authorization` values (api_key_patterns); without one of them a request is answered 401, as Envoy answers.
    api_keys_file: Path | None = None


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


UNAUTHENTICATED_BODY = "Client authentication failed."  # Envoy's api_key_auth filter's answer, word for word


def api_key_patterns(keys: Sequence[str]) -> str:
    """The accepted `Authorization` header values, one per line, for `Settings.api_keys_file`: "Bearer <key>", the
    form Envoy's api_key_auth filter strips to the key. A key with a space or a control character could not be a
    pattern line (nor an HTTP header value): refused."""
    if not keys:
        raise ProxyConfigError("API keys required but none given: every caller would be refused")
    for key in keys:
        if not key or any(c.isspace() or not c.isprintable() for c in key) or key.startswith("#"):
            raise ProxyConfigError("an API key holds a space, a control character or a leading '#'")
    return "".join(f"Bearer {key}\n" for key in keys)


def render_config(gateway: Gateway, routes: Sequence[Route], endpoints: Endpoints, settings: Settings,
                  retry: RetryPolicy | None = None) -> ProxyConfig:
    """HAProxy's configuration for `routes` on `gateway`, the backends being the pods in `endpoints`; with `retry`,
    a failed attempt is retried on another pod (gateway_retry.py)."""
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

    out = ["# Rendered by rehearsal/haproxy_config.py from the Gateway API objects; do not edit.",
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
                "    http-request set-header X-Forwarded-Proto https" if tls else ""]
        if settings.api_keys_file is not None:  # before any route: no key, no backend
            out += [f"    acl caller_authenticated req.hdr(authorization) -m str -f {settings.api_keys_file}",
                    f'    http-request return status 401 content-type text/plain string "{UNAUTHENTICATED_BODY}" '
                    "hdr www-authenticate Bearer if !caller_authenticated"]
        out += [
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
