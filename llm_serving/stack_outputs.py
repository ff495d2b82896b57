"""The stack outputs that client services read (docs/stack-outputs.md), as a typed shape with no Pulumi import.

A serving stack exports these top-level outputs: `schemaVersion`, `stack`, `environment`, `region`, `models`, and
since schema version 2 `experiments` and (once the batch path renders it) `batch` (and infrastructure details that
clients do not need). This is the one reader for services (llm_serving_client builds on it); infra/stack_reference.py
is the Pulumi side, for programs only. `parse_stack_outputs` validates a stack's outputs dict (from a
StackReference, `pulumi stack output --json`, or the mock runtime) and `StackOutputs.endpoint` resolves where to
send a request. Every lookup that cannot be answered raises `StackOutputsError` naming what was asked and what
exists, so a client misconfiguration is a clear message, never a silent default.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA_VERSION = 2
# What this reader reads: version 1 (before experiments, in-process marks and the batch block) parses with those
# absent. A version not listed is refused by name, so an old reader meeting a newer stack says so instead of
# misreading it (schema version 1's reader says "schemaVersion 2 is not supported (this client reads 1)").
READABLE_VERSIONS: tuple[int, ...] = (1, 2)
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


class InProcessVersion(_Shape):
    """Where the caller's process loads one version of an in-process model from: the published package directory in
    this stack's region (the model bucket's replica, the key `llm-serving publish` writes) and its I/O fingerprint,
    which the loaded package's must equal."""

    package: str = Field(pattern=r"^s3://[a-z0-9][a-z0-9.-]+/.+/$")
    io_fingerprint: str = Field(alias="ioFingerprint", pattern=r"^sha256:[0-9a-f]{64}$")


class InProcessOutputs(_Shape):
    """The stack marks a model for execution in the caller's process (a `python` model on CPU nodes only)."""

    versions: dict[str, InProcessVersion] = Field(min_length=1)


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
    # Schema version 2: null unless the stack marks the model `inProcess` (docs/clients.md, "In the caller's process").
    in_process: InProcessOutputs | None = Field(default=None, alias="inProcess")

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
        if self.in_process is not None:
            if self.kind != "python":
                raise ValueError(f"inProcess: only a python model runs in the caller's process, not kind {self.kind}")
            unknown = sorted(set(self.in_process.versions) - set(self.versions))
            if unknown:
                raise ValueError(f"inProcess.versions names {unknown}, versions are {self.versions}")
        return self


UnitKind = Literal["user", "profile", "request"]
UNIT_KINDS: tuple[str, ...] = ("user", "profile", "request")


class ArmOutputs(_Shape):
    """One arm of an experiment: a model, optionally one of its versions (a versioned model's own endpoint), the
    request parameters the arm adds, and its share of the units in percent."""

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9_-]{0,30}[a-z0-9])?$")
    model: str
    version: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    percent: float = Field(ge=0, le=100)


class ExperimentOutputs(_Shape):
    unit: UnitKind
    arms: list[ArmOutputs] = Field(min_length=2)

    @model_validator(mode="after")
    def _allocation(self) -> ExperimentOutputs:
        names = [a.name for a in self.arms]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"arms: duplicate arm names {dupes}")
        total, shares = sum(a.percent for a in self.arms), {a.name: a.percent for a in self.arms}
        if abs(total - 100) > 1e-9:
            raise ValueError(f"arms: percentages sum to {total:g}, not 100 ({shares})")
        return self


class BatchCache(_Shape):
    """Where the batch path's content-addressed results lie (read by its cache reader)."""

    bucket: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
    prefix: str = Field(pattern=r"^([A-Za-z0-9!_.*'()/-]+/)?$")
    region: str


class BatchOutputs(_Shape):
    """The stack's batch endpoint (OpenAI Files and Batches) and its result cache, once it serves the Batch API."""

    endpoint: str = Field(pattern=r"^https://[^/]+/v1$")
    cache: BatchCache


class StackOutputs(_Shape):
    schema_version: Literal[1, 2] = Field(alias="schemaVersion")
    stack: str
    environment: str
    region: str
    models: dict[str, ModelOutputs]
    experiments: dict[str, ExperimentOutputs] = Field(default_factory=dict)
    batch: BatchOutputs | None = None

    @model_validator(mode="after")
    def _experiments_name_served_versions(self) -> StackOutputs:
        for name, experiment in self.experiments.items():
            for arm in experiment.arms:
                where = f"experiments.{name}.arms[{arm.name}]"
                if arm.model not in self.models:
                    raise ValueError(f"{where}.model: {arm.model!r} is not served (served: {sorted(self.models)})")
                model = self.models[arm.model]
                if arm.version is None:
                    continue
                if model.strategy != "versioned":
                    raise ValueError(f"{where}.version: {arm.model!r} is red-black, one route for every version; "
                                     f"only a versioned model's arm pins a version")
                if arm.version not in model.versions:
                    raise ValueError(f"{where}.version: {arm.model!r} does not serve {arm.version!r} "
                                     f"(served: {model.versions})")
        return self

    def experiment(self, name: str) -> ExperimentOutputs:
        try:
            return self.experiments[name]
        except KeyError:
            raise StackOutputsError(f"experiment {name!r} is not declared in stack {self.stack} "
                                    f"(declared: {sorted(self.experiments)})") from None

    def model(self, model_id: str) -> ModelOutputs:
        try:
            return self.models[model_id]
        except KeyError:
            raise StackOutputsError(f"model {model_id!r} is not served by stack {self.stack} "
                                    f"(served: {sorted(self.models)})") from None

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


# The client contract's top-level keys; every other output is the operators'.
CLIENT_KEYS = ("schemaVersion", "stack", "environment", "region", "models", "experiments", "batch")


def parse_stack_outputs(outputs: Mapping[str, Any]) -> StackOutputs:
    """Validate the client-facing part of a serving stack's outputs (extra infrastructure outputs are ignored
    here on purpose: they are not part of the client contract)."""
    wanted = {k: outputs[k] for k in CLIENT_KEYS if k in outputs and outputs[k] is not None}
    if "schemaVersion" in wanted and wanted["schemaVersion"] not in READABLE_VERSIONS:
        raise StackOutputsError(f"schemaVersion {wanted['schemaVersion']!r} is not supported (this client reads "
                                f"{', '.join(map(str, READABLE_VERSIONS))})")
    if wanted.get("schemaVersion") == 1:
        extra = sorted(k for k in ("experiments", "batch") if k in wanted)
        if extra:
            raise StackOutputsError(f"schemaVersion 1 has no {extra}; a stack that exports them is version 2")
    try:
        return StackOutputs.model_validate(wanted)
    except ValidationError as exc:
        details = "; ".join(_describe(e) for e in exc.errors())
        raise StackOutputsError(f"not a serving stack's outputs: {details}") from None


def _describe(error: Any) -> str:
    """`models.chat-large.endpoints.grpc: Field required`; a validator's message that starts with its sub-key
    (`arms: ...`, `experiments.x.arms[cool].model: ...`) is joined to the location, so the key path reads whole."""
    loc = ".".join(map(str, error["loc"]))
    msg = error["msg"].removeprefix("Value error, ")
    head, sep, rest = msg.partition(": ")
    if sep and re.fullmatch(r"[A-Za-z][\w.\[\]-]*", head):
        return f"{head}: {rest}" if head.startswith("experiments.") or not loc else f"{loc}.{head}: {rest}"
    return f"{loc}: {msg}" if loc else msg
