"""Services as kube-proxy makes them: a virtual address per Service whose ports forward each connection to one of
the Service's endpoints, which are the Ready pods its selector selects (never a pod that is not Ready)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    pod: str
    address: str
    ports: dict[str, int]  # the pod's container ports by name


@dataclass
class ServiceProxy:
    name: str
    address: str
    ports: list[dict[str, Any]]  # the Service's spec.ports
    endpoints: Callable[[], list[Endpoint]]  # the Ready pods it selects, asked per connection
    servers: list[asyncio.AbstractServer] = field(default_factory=list)
    connections: int = 0
    refused: int = 0
    _rr: itertools.count = field(default_factory=itertools.count)

    def target_port(self, port: dict[str, Any], endpoint: Endpoint) -> int | None:
        target = port.get("targetPort", port["port"])
        if isinstance(target, str):
            return endpoint.ports.get(target)
        return int(target)

    async def start(self) -> None:
        for port in self.ports:
            server = await asyncio.start_server(lambda r, w, p=port: self._forward(r, w, p), self.address,
                                                int(port["port"]))
            self.servers.append(server)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: dict) -> None:
        ready = [e for e in self.endpoints() if self.target_port(port, e) is not None]
        if not ready:  # no endpoints: the connection is refused, as kube-proxy rejects it
            self.refused += 1
            writer.close()
            return
        endpoint = ready[next(self._rr) % len(ready)]
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(endpoint.address, self.target_port(port, endpoint))
        except OSError:
            self.refused += 1
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                try:
                    dst.close()
                except RuntimeError:
                    pass

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        for server in self.servers:
            server.close()
            await server.wait_closed()
