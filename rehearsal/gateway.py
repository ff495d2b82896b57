"""The rehearsal's gateway (docs/rehearsal.md, "Rollouts under load", the gateway row): the rendered Gateway's
listeners as a real HAProxy (haproxy_config.py, haproxy_process.py) with TLS from the rehearsal's own CA (tls.py),
over the rendered routes and the Ready pods, and the cluster (cluster.py) that carries out the rollout's steps on it.
Started once: the experiment and then the scenarios go through the same gateway.

Caller authentication as rendered: a SecurityPolicy with `apiKeyAuth` on the Gateway makes HAProxy answer 401 to a
request without one of its credentialRefs' keys (the Secrets the rehearsal made, secrets.py). Once started, the
gateway shows the three access cases (`access_checks`): no credential -> 401 at the gateway; a direct call from
another pod's network namespace to a model pod -> refused by the node's NetworkPolicy rules (net.py); the gateway's
call with the rehearsal client's key -> served.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from llm_serving import pod_contract as pc
from rehearsal import haproxy_config, render
from rehearsal.cluster import RehearsalCluster
from rehearsal.haproxy_process import HAProxy
from rehearsal.node import Node
from rehearsal.secrets import SecretsPlan
from rehearsal.tls import CertificateAuthority

SECURITY_POLICY = "kubernetes:gateway.envoyproxy.io/v1alpha1:SecurityPolicy"


def gateway_api_keys(policies: Sequence[Mapping[str, Any]], gateway_name: str, namespace: str,
                     secrets: SecretsPlan | None) -> list[str] | None:
    """The keys the rendered SecurityPolicies (their `inputs`) accept on the Gateway `gateway_name`, from their
    credentialRefs' Secrets as the rehearsal made them; None when no policy authenticates on it. A policy on a route
    alone, or a JWT one, is refused (the rehearsal renders API keys on the Gateway), as is a key Secret it lacks."""
    keys: list[str] = []
    found = False
    for policy in policies:
        spec = policy.get("spec") or {}
        if (policy.get("metadata") or {}).get("namespace", "default") != namespace:
            continue
        targets = [t for t in spec.get("targetRefs") or [] if t.get("kind") == "Gateway"
                   and t.get("name") == gateway_name]
        if not targets:
            if spec.get("apiKeyAuth") or spec.get("jwt"):
                raise haproxy_config.ProxyConfigError(
                    f"SecurityPolicy {policy['metadata'].get('name')}: the rehearsal's gateway renders caller "
                    f"authentication on the Gateway {gateway_name} only, not on {spec.get('targetRefs')}")
            continue
        if spec.get("jwt"):
            raise haproxy_config.ProxyConfigError(f"SecurityPolicy {policy['metadata'].get('name')}: JWT is not "
                                                  "rendered by the rehearsal's gateway (API keys are)")
        auth = spec.get("apiKeyAuth")
        if not auth:
            continue
        found = True
        for ref in auth.get("credentialRefs") or []:
            data = (secrets.secrets if secrets else {}).get(ref.get("name"))
            if data is None:
                raise haproxy_config.ProxyConfigError(
                    f"SecurityPolicy {policy['metadata'].get('name')}: its key Secret {ref.get('name')!r} is none "
                    "the rehearsal made (no ExternalSecret produces it)")
            keys += list(data.values())
    return sorted(set(keys)) if found else None


@dataclass(frozen=True)
class AccessCheck:
    case: str
    outcome: str
    ok: bool

    @property
    def line(self) -> str:
        return f"access: {self.case} -> {self.outcome} [{'ok' if self.ok else 'NOT ENFORCED'}]"


def connect_outcome(namespace: str, address: str, port: int, timeout_s: float = 5.0) -> str:
    """What a TCP connection to address:port from network namespace `namespace` meets: "refused", "dropped" (no
    answer within the timeout) or "connected"."""
    code = ("import socket,sys\n"
            "try:\n"
            f"    socket.create_connection(({address!r}, {port}), timeout={timeout_s}).close(); print('connected')\n"
            "except ConnectionRefusedError: print('refused')\n"
            "except (TimeoutError, socket.timeout): print('dropped')\n")
    proc = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=timeout_s + 30)
    return proc.stdout.strip() or f"error: {proc.stderr.strip()[-200:]}"


@dataclass
class RehearsalGateway:
    haproxy: HAProxy
    cluster: RehearsalCluster
    port: int  # on 127.0.0.1: the listeners on 443
    ca: CertificateAuthority  # what a client trusts
    domain: str
    node: Node | None = None
    api_key: str | None = None  # the rehearsal client's key (None: the stack renders no caller authentication)
    access: list[AccessCheck] = field(default_factory=list)

    def start(self, console: Console) -> None:
        self.haproxy.start(self.cluster.proxy_config())
        console.print(f"gateway: HAProxy on 127.0.0.1:{self.port} for the listeners on 443 (*.{self.domain}, "
                      f"*.grpc.{self.domain}), TLS from the rehearsal's CA"
                      + (", API keys required (the rendered SecurityPolicy)" if self.api_key else
                         ", no caller authentication rendered"))
        try:
            self.access = self.access_checks()
        except Exception as exc:  # shown, never hidden: the three cases are the report's
            self.access = [AccessCheck("access checks", f"could not run: {exc!r}", False)]
        for check in self.access:
            # Plain text: the line's own "[ok]" is not console markup.
            console.print(check.line, style=None if check.ok else "red", markup=False, highlight=False)

    def access_checks(self) -> list[AccessCheck]:
        """The three access cases, on a Ready model pod and its route's host."""
        node = self.node
        hosts = self.cluster.routed_hosts()  # the host a route gives each Ready pod
        runners = [r for r in (node.runners if node else []) if r.status.ready and r.plan.name in hosts
                   and r.plan.labels.get("app.kubernetes.io/component") == "model-server"
                   and pc.OPENAI_PORT_NAME in r.plan.ports]
        if node is None or not runners:
            return [AccessCheck("access checks", "no Ready model pod that a route reaches", False)]
        target = runners[0]
        host = hosts[target.plan.name]
        # KServe's readiness: every model pod serves it whatever its kind (a ranker has no OpenAI models), the route
        # sends /v2 to it, and the gateway asks for a key on every path.
        url = f"https://127.0.0.1:{self.port}{pc.READY_PATH}"
        verify = self.ca.httpx_verify()
        out = []
        with httpx.Client(verify=verify, timeout=30) as client:
            bare = client.get(url, headers={"Host": host}, extensions={"sni_hostname": host})
            out.append(AccessCheck(f"no credential, through the gateway ({host})", f"{bare.status_code}",
                                   bare.status_code == 401))
            namespace, _ = node.net.create_pod(node.pod_count)  # another pod's namespace: no container in it
            node.pod_count += 1
            port = target.plan.ports[pc.OPENAI_PORT_NAME]
            outcome = connect_outcome(namespace, target.status.address, port)
            out.append(AccessCheck(f"direct from another pod's namespace to {target.plan.name} "
                                   f"{target.status.address}:{port}", outcome, outcome in ("refused", "dropped")))
            headers = {"Host": host, **({pc.AUTHORIZATION_HEADER: pc.bearer_value(self.api_key)}
                                       if self.api_key else {})}
            served = client.get(url, headers=headers, extensions={"sni_hostname": host})
            out.append(AccessCheck(f"the gateway's call with the rehearsal client's key ({host})",
                                   f"{served.status_code}", served.status_code == 200))
        return out

    def stop(self) -> None:
        self.haproxy.stop()


def create_gateway(rendered: render.Rendered, workdir: Path, node: Node, port: int,
                   on_pods_changed: Callable[[], None]) -> RehearsalGateway:
    """The gateway's certificate, configuration and cluster under `workdir`, HAProxy not started yet: the caller
    holds it before it starts, so that a start that fails half-way is still stopped at cleanup."""
    workdir.mkdir()
    ca = CertificateAuthority.create(workdir / "ca")
    domain = rendered.config["llm-serving:serving"]["domain"]
    certificate = ca.issue([f"*.{domain}", f"*.grpc.{domain}"], workdir / "tls")
    namespace = rendered.config["llm-serving:serving"].get("namespace") or "llm-serving"
    gateways = [g["inputs"]["metadata"]["name"] for g in rendered.of_type(
        "kubernetes:gateway.networking.k8s.io/v1:Gateway")]
    keys = None
    for name in gateways:
        keys = gateway_api_keys([p["inputs"] for p in rendered.of_type(SECURITY_POLICY)], name, namespace,
                                node.secrets) or keys
    keys_file = None
    if keys is not None:
        keys_file = workdir / "api-keys.acl"
        keys_file.write_text(haproxy_config.api_key_patterns(keys))
        keys_file.chmod(0o600)
    settings = haproxy_config.Settings(binds={443: ("127.0.0.1", port)}, admin_socket=workdir / "admin.sock",
                                       certificate=certificate.pem_path, api_keys_file=keys_file)
    haproxy = HAProxy(workdir)
    cluster = RehearsalCluster(rendered.resources, node.runners, node.plans_for, node.add_pod, node.start_pod,
                               haproxy, settings, on_pods_changed=on_pods_changed)
    return RehearsalGateway(haproxy, cluster, port, ca, domain, node,
                            node.secrets.client_key() if keys is not None and node.secrets else None)
