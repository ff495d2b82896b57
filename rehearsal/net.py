"""Network namespaces for a rehearsal, like a Kubernetes node's: one "node" namespace with a bridge (where the
kubelet's probes, the Services' proxies, Prometheus and the traffic run: this process enters it) and one namespace
per pod, joined to the bridge by a veth pair. Every address lives in a namespace the rehearsal created; nothing is
added to the machine's own network namespace. Everything is removed by `close()`.

NetworkPolicies are enforced in the node namespace as a CNI does on a node: the bridge hands its frames to iptables
(br_netfilter, `net.bridge.bridge-nf-call-iptables=1` in that namespace alone), and each pod selected by a rendered
NetworkPolicy gets rules in NETPOL_CHAIN (ingress_rules, pure): what a policy's ingress admits is accepted, a new
TCP connection otherwise is reset, anything else dropped. Traffic between pods crosses the bridge (FORWARD); what the
node namespace itself sends (the gateway, Prometheus, the probes, the Services' proxies) does not, as host traffic
passes a node's policies. Peers: the gateway's proxies and the monitoring namespace are this node namespace here.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CLONE_NEWNET = 0x40000000
SUBNET = ipaddress.ip_network("10.213.0.0/16")
GATEWAY = ipaddress.ip_address("10.213.0.1")
POD_BASE = ipaddress.ip_address("10.213.1.1")
SERVICE_BASE = ipaddress.ip_address("10.213.200.1")
BRIDGE = "rhbr0"


NETPOL_CHAIN = "LLM-REHEARSAL-NETPOL"
# Where Envoy Gateway runs the Gateway's proxies (infra/bootstrap.py GATEWAY_NAMESPACE; tests/infra holds them
# equal): a NetworkPolicy peer there is the rehearsal's gateway, in the node namespace.
GATEWAY_PROXY_NAMESPACE = "envoy-gateway-system"


class NetError(RuntimeError):
    pass


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    match = (selector or {}).get("matchLabels") or {}
    if (selector or {}).get("matchExpressions"):
        raise NetError(f"podSelector {selector}: the rehearsal reads matchLabels only")
    return all(labels.get(k) == v for k, v in match.items())


def policy_rules(policies: Sequence[Mapping[str, Any]], namespace: str, labels: Mapping[str, str],
                 node_namespaces: Sequence[str]) -> list[tuple[list[str] | None, list[int] | None]] | None:
    """What the rendered NetworkPolicies (their `inputs`) admit into a pod of `namespace` with `labels`: None when
    none selects it for Ingress (all traffic admitted), else (sources, ports) per ingress rule, a source list of None
    being any source and ports None every port. A peer in one of `node_namespaces` (where the rehearsal runs the
    gateway's proxies and Prometheus: the node namespace) is GATEWAY's address; any other peer is refused."""
    selecting = [p for p in policies if (p.get("metadata") or {}).get("namespace", "default") == namespace
                 and _selects((p.get("spec") or {}).get("podSelector"), labels)
                 and "Ingress" in ((p.get("spec") or {}).get("policyTypes") or ["Ingress"])]
    if not selecting:
        return None
    rules: list[tuple[list[str] | None, list[int] | None]] = []
    for policy in selecting:
        for rule in (policy.get("spec") or {}).get("ingress") or []:
            ports = [int(p["port"]) for p in rule.get("ports") or [] if p.get("port") is not None] or None
            peers = rule.get("from")
            if not peers:
                rules.append((None, ports))
                continue
            sources = []
            for peer in peers:
                if "ipBlock" in peer:
                    sources.append(str(peer["ipBlock"]["cidr"]))
                    continue
                ns = ((peer.get("namespaceSelector") or {}).get("matchLabels") or {}).get(
                    "kubernetes.io/metadata.name")
                if ns in node_namespaces:
                    sources.append(f"{GATEWAY}/32")
                else:
                    raise NetError(f"NetworkPolicy {policy['metadata'].get('name')}: peer {peer} is none the "
                                   f"rehearsal runs (namespaces {sorted(node_namespaces)} are its node namespace)")
            rules.append((sources, ports))
    return rules


def ingress_rules(address: str, rules: Sequence[tuple[Sequence[str] | None, Sequence[int] | None]]) -> list[str]:
    """iptables rules (arguments of `iptables`, each a line) for one pod at `address`: each admitted (sources,
    ports) accepted, then a new TCP connection reset (the caller sees "connection refused") and the rest dropped."""
    out = []
    for sources, ports in rules:
        port_args = f" -p tcp -m multiport --dports {','.join(str(p) for p in ports)}" if ports else ""
        for source in sources if sources is not None else [None]:
            source_args = f" -s {source}" if source else ""
            out.append(f"-A {NETPOL_CHAIN} -d {address}/32{source_args}{port_args} -j ACCEPT")
    out.append(f"-A {NETPOL_CHAIN} -d {address}/32 -p tcp -j REJECT --reject-with tcp-reset")
    out.append(f"-A {NETPOL_CHAIN} -d {address}/32 -j DROP")
    return out


NETPOL_SETUP = (f"-N {NETPOL_CHAIN}",
                "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
                f"-A FORWARD -j {NETPOL_CHAIN}")


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def pod_address(index: int) -> str:
    return str(POD_BASE + index)


def service_address(index: int) -> str:
    return str(SERVICE_BASE + index)


@dataclass
class Network:
    prefix: str  # unique per run, e.g. "rh1234"
    namespaces: list[str] = field(default_factory=list)
    entered: bool = False

    @property
    def node(self) -> str:
        return f"{self.prefix}-node"

    def create_node(self) -> None:
        _ip("netns", "add", self.node)
        self.namespaces.append(self.node)
        _ip("-n", self.node, "link", "set", "lo", "up")
        _ip("-n", self.node, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.node, "addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
        _ip("-n", self.node, "link", "set", BRIDGE, "up")
        self.enforce_policies()

    def enter_node(self) -> None:
        """Move this process (its calling thread: call before any thread starts) into the node namespace."""
        fd = os.open(f"/run/netns/{self.node}", os.O_RDONLY)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise NetError(f"setns({self.node}): {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
        self.entered = True

    def _iptables(self, rule: str) -> None:
        proc = subprocess.run(["ip", "netns", "exec", self.node, "iptables", "-w", *rule.split()],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise NetError(f"iptables {rule} (namespace {self.node}): {proc.stderr.strip()}")

    def enforce_policies(self) -> None:
        """Bridged traffic through iptables in the node namespace (br_netfilter), and NETPOL_CHAIN on FORWARD."""
        subprocess.run(["modprobe", "br_netfilter"], capture_output=True)
        proc = subprocess.run(["ip", "netns", "exec", self.node, "sysctl", "-qw",
                               "net.bridge.bridge-nf-call-iptables=1"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise NetError(f"cannot hand bridged traffic to iptables in {self.node} (br_netfilter): "
                           f"{proc.stderr.strip()}")
        for rule in NETPOL_SETUP:
            self._iptables(rule)

    def restrict_pod(self, address: str, rules) -> None:
        """A pod's NetworkPolicy rules (policy_rules' answer, not None) in NETPOL_CHAIN."""
        for rule in ingress_rules(address, rules):
            self._iptables(rule)

    def add_service_address(self, address: str) -> None:
        _ip("-n", self.node, "addr", "add", f"{address}/32", "dev", BRIDGE)

    def create_pod(self, index: int) -> tuple[str, str]:
        """(namespace, address) of a new pod namespace joined to the node's bridge."""
        name = f"{self.prefix}-p{index}"
        address = pod_address(index)
        _ip("netns", "add", name)
        self.namespaces.append(name)
        host_end = f"{self.prefix[-6:]}v{index}"[-15:]
        _ip("-n", self.node, "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("-n", self.node, "link", "set", host_end, "master", BRIDGE)
        _ip("-n", self.node, "link", "set", host_end, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "route", "add", "default", "via", str(GATEWAY))
        return name, address

    def close(self) -> None:
        for name in reversed(list(self.namespaces)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.namespaces.clear()
