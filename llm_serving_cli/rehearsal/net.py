"""Network namespaces for a rehearsal, like a Kubernetes node's: one "node" namespace with a bridge (where the
kubelet's probes, the Services' proxies, Prometheus and the traffic run: this process enters it) and one namespace
per pod, joined to the bridge by a veth pair. Every address lives in a namespace the rehearsal created; nothing is
added to the machine's own network namespace. Everything is removed by `close()`.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import subprocess
from dataclasses import dataclass, field

CLONE_NEWNET = 0x40000000
SUBNET = ipaddress.ip_network("10.213.0.0/16")
GATEWAY = ipaddress.ip_address("10.213.0.1")
POD_BASE = ipaddress.ip_address("10.213.1.1")
SERVICE_BASE = ipaddress.ip_address("10.213.200.1")
BRIDGE = "rhbr0"


class NetError(RuntimeError):
    pass


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
