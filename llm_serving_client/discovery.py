"""Discovery (docs/clients.md, "Discovery"): the stack outputs a service's deployment renders for it, read from a
file, and the route of each call. Built on llm_serving.stack_outputs, the one reader of that shape; nothing here
talks to Pulumi.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from llm_serving.stack_outputs import ModelOutputs, StackOutputs, StackOutputsError, parse_stack_outputs
from llm_serving_client.gateway import GatewayEndpoints

ENV_OUTPUTS = "LLM_SERVING_STACK_OUTPUTS"  # the file's path, as the service's ConfigMap mounts it


def load_outputs(path: str | os.PathLike | None = None) -> StackOutputs:
    """The stack outputs from `path` (default: $LLM_SERVING_STACK_OUTPUTS); every failure names the file."""
    if path is None:
        path = os.environ.get(ENV_OUTPUTS)
        if not path:
            raise StackOutputsError(f"no stack outputs: pass a path or set {ENV_OUTPUTS} to the JSON file the "
                                    f"service's deployment renders (docs/clients.md, 'Discovery')")
    file = Path(path)
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise StackOutputsError(f"{file}: no such stack-outputs file") from None
    except json.JSONDecodeError as exc:
        raise StackOutputsError(f"{file}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise StackOutputsError(f"{file}: a stack-outputs document is a JSON object, got {type(raw).__name__}")
    try:
        return parse_stack_outputs(raw)
    except StackOutputsError as exc:
        raise StackOutputsError(f"{file}: {exc}") from None


@dataclass(frozen=True)
class LocalEndpoints:
    """Every model at one local server (`make up`, the tests): plain HTTP and gRPC without TLS. Production routes
    always come from the outputs."""

    openai: str  # e.g. http://127.0.0.1:9000/v1
    grpc: str  # e.g. 127.0.0.1:8001


@dataclass(frozen=True)
class Route:
    model: str
    kind: str
    version: str | None  # the pinned version (a versioned model), None where the platform routes by weight
    address: str
    tls: bool
    gateway: GatewayEndpoints | None = None  # set: `address` keeps its hostname, the connection goes to the gateway


# Which protocol answers which kind (docs/stack-outputs.md, `models.<id>.kind`).
OPENAI_KINDS = ("vllm",)


class Discovery:
    def __init__(self, outputs: StackOutputs, local: LocalEndpoints | None = None,
                 gateway: GatewayEndpoints | None = None):
        if local is not None and gateway is not None:
            raise ValueError("local endpoints and a gateway address contradict each other: a local server has no "
                             "gateway, a gateway routes by the stack's hostnames")
        self.outputs, self.local, self.gateway = outputs, local, gateway

    def model(self, model_id: str) -> ModelOutputs:
        return self.outputs.model(model_id)

    def route(self, model_id: str, protocol: str, version: str | None = None) -> Route:
        model = self.outputs.model(model_id)
        if protocol == "openai" and model.kind not in OPENAI_KINDS:
            raise StackOutputsError(f"model {model_id!r} is kind {model.kind}: it answers KServe v2 tensor "
                                    f"inference (grpc), not the OpenAI API")
        address = self.outputs.endpoint(model_id, protocol, version)  # refuses a version it does not serve
        if self.local is not None:
            return Route(model_id, model.kind, version, getattr(self.local, protocol), tls=False)
        return Route(model_id, model.kind, version, address, tls=True, gateway=self.gateway)
