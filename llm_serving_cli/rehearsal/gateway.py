"""The rehearsal's gateway (docs/rehearsal.md, "Rollouts under load", the gateway row): the rendered Gateway's
listeners as a real HAProxy (haproxy_config.py, haproxy_process.py) with TLS from the rehearsal's own CA (tls.py),
over the rendered routes and the Ready pods, and the cluster (cluster.py) that carries out the rollout's steps on it.
Started once: the experiment and then the scenarios go through the same gateway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from llm_serving_cli.rehearsal import haproxy_config, render
from llm_serving_cli.rehearsal.cluster import RehearsalCluster
from llm_serving_cli.rehearsal.haproxy_process import HAProxy
from llm_serving_cli.rehearsal.node import Node
from llm_serving_cli.rehearsal.tls import CertificateAuthority


@dataclass(frozen=True)
class RehearsalGateway:
    haproxy: HAProxy
    cluster: RehearsalCluster
    port: int  # on 127.0.0.1: the listeners on 443
    ca: CertificateAuthority  # what a client trusts
    domain: str

    def start(self, console: Console) -> None:
        self.haproxy.start(self.cluster.proxy_config())
        console.print(f"gateway: HAProxy on 127.0.0.1:{self.port} for the listeners on 443 (*.{self.domain}, "
                      f"*.grpc.{self.domain}), TLS from the rehearsal's CA")

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
    settings = haproxy_config.Settings(binds={443: ("127.0.0.1", port)}, admin_socket=workdir / "admin.sock",
                                       certificate=certificate.pem_path)
    haproxy = HAProxy(workdir)
    cluster = RehearsalCluster(rendered.resources, node.runners, node.plans_for, node.add_pod, node.start_pod,
                               haproxy, settings, on_pods_changed=on_pods_changed)
    return RehearsalGateway(haproxy, cluster, port, ca, domain)
