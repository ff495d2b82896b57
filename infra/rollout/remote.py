"""The rehearsal's cluster seen from the rollout side (infra.rollout.runner.RehearsalRunner): each step of an update
sent to `make rehearse` over its Unix control socket. Standard library only, so that both environments import it
(the rehearsal's tests drive rehearsal/cluster.py through it)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from infra.rollout import simulator
from infra.rollout.simulator import Node


class RemoteCluster:
    """The rehearsal's cluster (rehearsal/cluster.py) over its Unix control socket: one JSON object
    per line each way, one request per connection. A step the rehearsal cannot carry out answers {"error": ...},
    raised as simulator.UpdateError. A Deployment step returns once its pods are ready or its deadline passed, so the
    timeout here is long: the rehearsal, not this client, owns the deadline (the Deployment's own)."""

    def __init__(self, path: Path, timeout_s: float = 3600):
        self.path = Path(path)
        self.timeout_s = timeout_s

    def _call(self, message: dict) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(self.timeout_s)
            try:
                conn.connect(str(self.path))
                conn.sendall(json.dumps(message).encode() + b"\n")
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            except OSError as err:
                raise simulator.UpdateError(f"the rehearsal's control socket {self.path}: {err}") from None
        if not data:
            raise simulator.UpdateError(f"the rehearsal closed its control socket {self.path} without an answer")
        reply = json.loads(data)
        if "error" in reply:
            raise simulator.UpdateError(reply["error"])
        return reply

    def apply(self, node: Node, previous: simulator.LiveResource | None) -> int:
        return int(self._call({"op": "apply", "type": node.type, "name": node.name, "inputs": node.inputs})["ready"])

    def delete(self, resource: simulator.LiveResource) -> None:
        self._call({"op": "delete", "type": resource.type, "name": resource.name, "inputs": resource.inputs})
