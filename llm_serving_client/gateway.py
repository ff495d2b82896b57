"""Reaching the stack's hostnames at one gateway address (docs/clients.md, "Discovery"): what curl's `--connect-to`
does. Every route keeps the URL the stack outputs name, so TLS is checked against the model's hostname (SNI) and the
gateway routes by it (HTTP `Host`, gRPC `:authority`); only the TCP connection goes to `address`. The rehearsal's
gateway on loopback (`make rehearse`) is reached this way, and so is a gateway whose hostnames a caller's DNS does
not resolve yet.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import httpx


class GatewayError(ValueError):
    pass


@dataclass(frozen=True)
class GatewayEndpoints:
    address: str  # `host:port` dialled for every route
    ca_file: str | None = None  # PEM bundle that signs the gateway's certificate (None: the system's trust store)

    def __post_init__(self) -> None:
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise GatewayError(f"gateway address {self.address!r} is not host:port")
        if self.ca_file is not None and not Path(self.ca_file).is_file():
            raise GatewayError(f"gateway CA file {self.ca_file}: no such file")

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def ssl_context(self) -> ssl.SSLContext:
        """The trust for the gateway's certificate; hostnames are checked (against the model's, the SNI)."""
        return ssl.create_default_context(cafile=self.ca_file)


class GatewayTransport(httpx.BaseTransport):
    """An httpx transport that sends each request to the gateway's address, its TLS server name and `Host` header
    left as the URL's. One per hostname (the OpenAI transport makes one client per base URL): a pooled connection,
    whose TLS session carries one SNI, is never reused for another model's hostname."""

    def __init__(self, gateway: GatewayEndpoints):
        self._gateway = gateway
        self._inner = httpx.HTTPTransport(verify=gateway.ssl_context())

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        # httpx set the Host header from the URL when the request was built; only where to connect changes.
        name = request.url.host
        request.url = request.url.copy_with(host=self._gateway.host, port=self._gateway.port)
        request.extensions = {**request.extensions, "sni_hostname": name}
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()
