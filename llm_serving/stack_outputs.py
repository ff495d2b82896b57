"""The stack outputs that client services read (docs/stack-outputs.md), as a typed shape with no Pulumi import.

A serving stack exports these top-level outputs: `schemaVersion`, `stack`, `environment`, `region`, `models` (and
infrastructure details that clients do not need). `parse_stack_outputs` validates a stack's outputs dict (from a
StackReference, `pulumi stack output --json`, or the mock runtime) and `StackOutputs.endpoint` resolves where to
send a request. Every lookup that cannot be answered raises `StackOutputsError` naming what was asked and what
exists, so a client misconfiguration is a clear message, never a silent default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA_VERSION = 1
Protocol = Literal["openai", "grpc", "kserve_http"]
PROTOCOLS: tuple[str, ...] = ("openai", "grpc", "kserve_http")


class StackOutputsError(ValueError):
    pass


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Endpoints(_Shape):
    openai: str = Field(pattern=r"^https://[^/]+/v1$", description="OpenAI-compatible base URL")
    grpc: str = Field(pattern=r"^[^/:]+:\d+$", description="KServe v2 gRPC target host:port (TLS)")
    kserve_http: str = Field(alias="kserveHttp", pattern=r"^https://[^/]+$", description="KServe v2 HTTP base URL")


# What a model is, by the `model.backend` of its packages (llm_serving.manifest.Backend): an LLM (`vllm`: streamed
# generation, OpenAI and KServe), a Python-backend model (`python`: e.g. the XGBoost ranker, unary KServe
# ModelInfer) or a Triton ensemble (`ensemble`: called as one model). Every kind answers the same KServe v2 call.
ModelKind = Literal["vllm", "python", "ensemble"]
MODEL_KINDS: tuple[str, ...] = ("vllm", "python", "ensemble")


class ModelOutputs(_Shape):
    kind: ModelKind
    strategy: Literal["red-black", "versioned"]
    region: str
    versions: list[str] = Field(min_length=1)
    active_version: str = Field(alias="activeVersion")
    route_weights: dict[str, int] = Field(alias="routeWeights")
    replicas: dict[str, int]
    endpoints: Endpoints
    version_endpoints: dict[str, Endpoints] = Field(alias="versionEndpoints")

    @model_validator(mode="after")
    def _consistent(self) -> ModelOutputs:
        if self.active_version not in self.versions:
            raise ValueError(f"activeVersion {self.active_version!r} is not among versions {self.versions}")
        if set(self.route_weights) != set(self.versions):
            raise ValueError(f"routeWeights names {sorted(self.route_weights)}, versions are {self.versions}")
        if self.strategy == "red-black" and sum(self.route_weights.values()) != 100:
            raise ValueError(f"red-black routeWeights must sum to 100, got {self.route_weights}")
        if self.strategy == "versioned" and set(self.version_endpoints) != set(self.versions):
            raise ValueError("a versioned model has one versionEndpoints entry per version")
        return self


class StackOutputs(_Shape):
    schema_version: Literal[1] = Field(alias="schemaVersion")
    stack: str
    environment: str
    region: str
    models: dict[str, ModelOutputs]

    def model(self, model_id: str) -> ModelOutputs:
        try:
            return self.models[model_id]
        except KeyError:
            raise StackOutputsError(f"model {model_id!r} is not served by stack {self.stack} "
                                    f"(served: {sorted(self.models)})") from None

    def of_kind(self, kind: str) -> list[str]:
        """The ids of the models of one kind (`vllm`, `python`, `ensemble`), sorted."""
        if kind not in MODEL_KINDS:
            raise StackOutputsError(f"kind {kind!r} is not one of {list(MODEL_KINDS)}")
        return sorted(m for m, out in self.models.items() if out.kind == kind)

    def endpoint(self, model_id: str, protocol: str = "openai", version: str | None = None) -> str:
        """The address for `protocol` of `model_id`; for a versioned model, `version` picks one version's route
        (default: the newest). A red-black model has one route whose weights the platform moves, so a client
        never names a version there."""
        if protocol not in PROTOCOLS:
            raise StackOutputsError(f"protocol {protocol!r} is not one of {list(PROTOCOLS)}")
        model = self.model(model_id)
        if version is None:
            endpoints = model.endpoints
        elif model.strategy == "red-black":
            raise StackOutputsError(f"model {model_id!r} is red-black: its one endpoint serves "
                                    f"{model.route_weights}; do not pin a version")
        elif version not in model.version_endpoints:
            raise StackOutputsError(f"model {model_id!r} does not serve version {version!r} in {self.stack} "
                                    f"(served: {model.versions})")
        else:
            endpoints = model.version_endpoints[version]
        return getattr(endpoints, protocol)


def parse_stack_outputs(outputs: Mapping[str, Any]) -> StackOutputs:
    """Validate the client-facing part of a serving stack's outputs (extra infrastructure outputs are ignored
    here on purpose: they are not part of the client contract)."""
    wanted = {k: outputs[k] for k in ("schemaVersion", "stack", "environment", "region", "models") if k in outputs}
    if "schemaVersion" in wanted and wanted["schemaVersion"] != SCHEMA_VERSION:
        raise StackOutputsError(f"schemaVersion {wanted['schemaVersion']!r} is not supported (this client reads "
                                f"{SCHEMA_VERSION})")
    try:
        return StackOutputs.model_validate(wanted)
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise StackOutputsError(f"not a serving stack's outputs: {details}") from None
