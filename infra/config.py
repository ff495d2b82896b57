"""Typed stack configuration (docs/architecture.md §3.6), validated once at program start.

Every value a stack file sets is checked here before any resource exists, and a wrong one fails with a message that
names the full key (`llm-serving:models[1].strategy`) and what is allowed. Nothing is silently dropped: unknown keys
are errors too. This module has no Pulumi import so that tools (rollout, policies, docs) can validate a stack file
without the runtime; `from_pulumi_config()` is the program's entry.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from infra.instances import INSTANCE_FACTS, MIN_IMAGE_VOLUME_GIB
from infra.model_fit import OTHER_GPU_MEMORY_UTILIZATION, LoadTime, engine_budget, gpu_memory_fit
from llm_serving.compat import COMPAT_PATH, CompatError, load_compat
from llm_serving.manifest import Backend, ParallelLayout, VllmEngine
from llm_serving.pod_contract import PodContractError, package_uri, parse_package_uri
from llm_serving.python_deps import DependencyError, parse_requirements
from llm_serving.repository import REPO_ROOT
from llm_serving.tensor_contract import VLLM_IO_FINGERPRINT

PROJECT = "llm-serving"
COMPAT_TOML = COMPAT_PATH

# Keys of the project namespace that the program reads; any other `llm-serving:` key is a typo, and an error.
TOP_LEVEL_KEYS = ("environment", "team", "homeRegion", "network", "cluster", "modelStorage", "serving", "models",
                  "experiments")

_ID_RE = r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$"  # a DNS label short enough for "<id>-<version slug>" names
_VERSION_RE = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,30}[A-Za-z0-9])?$"
_FINGERPRINT_RE = r"^sha256:[0-9a-f]{64}$"
_REGION_RE = r"^[a-z]{2}(-gov)?-[a-z]+-\d$"


class ConfigError(ValueError):
    """A stack config value the program cannot use; the message names the key and the allowed values."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def repeated(values: list[str]) -> list[str]:
    """The values named more than once, sorted: what a list of names or ids that must be unique got wrong."""
    return sorted({v for v in values if values.count(v) > 1})


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.capitalize() for p in rest)


class _Camel(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, alias_generator=_camel)


# -- network -----------------------------------------------------------------------------------------------------


class NetworkConfig(_Camel):
    """A new VPC (`cidr`) or an existing one (`vpc_id` with its three private subnets)."""

    cidr: str = "10.0.0.0/16"
    vpc_id: str | None = Field(default=None, pattern=r"^vpc-[0-9a-f]{8,17}$")
    private_subnet_ids: list[Annotated[str, Field(pattern=r"^subnet-[0-9a-f]{8,17}$")]] | None = None

    @field_validator("cidr")
    @classmethod
    def _check_cidr(cls, v: str) -> str:
        import ipaddress

        net = ipaddress.ip_network(v, strict=True)
        if net.prefixlen > 20:
            raise ValueError(f"must be a /20 or larger block to hold six /24+ subnets, got {v!r}")
        return v

    @model_validator(mode="after")
    def _existing_vpc_needs_subnets(self) -> NetworkConfig:
        if self.vpc_id and (not self.private_subnet_ids or len(self.private_subnet_ids) != 3):
            raise ValueError("privateSubnetIds: an existing vpcId needs exactly 3 private subnet ids, one per AZ")
        if self.private_subnet_ids and not self.vpc_id:
            raise ValueError("privateSubnetIds is only allowed together with vpcId")
        return self


# -- cluster -----------------------------------------------------------------------------------------------------

# AMIs whose image already runs NVIDIA's device plugin (Bottlerocket's NVIDIA variants) and those that only carry
# the driver and container toolkit (EKS-optimized AL2023/AL2 NVIDIA AMIs), for which the program installs it.
AMIS_WITH_DEVICE_PLUGIN = ("BOTTLEROCKET_x86_64_NVIDIA", "BOTTLEROCKET_ARM_64_NVIDIA")
AMIS_WITHOUT_DEVICE_PLUGIN = ("AL2023_x86_64_NVIDIA", "AL2023_ARM_64_NVIDIA")
GpuAmiType = Literal[
    "AL2023_x86_64_NVIDIA", "AL2023_ARM_64_NVIDIA", "BOTTLEROCKET_x86_64_NVIDIA", "BOTTLEROCKET_ARM_64_NVIDIA"
]
# Instance families with NVIDIA GPUs (and, for `efa: true`, those that have EFA interfaces).
GPU_INSTANCE_FAMILIES = ("g5", "g6", "g6e", "gr6", "p4d", "p4de", "p5", "p5e", "p5en", "p6-b200")
EFA_INSTANCE_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "g6e")


class ScalingConfig(_Camel):
    min_size: int = Field(ge=0, le=1000)
    max_size: int = Field(ge=1, le=1000)
    desired_size: int = Field(ge=0, le=1000)

    @model_validator(mode="after")
    def _ordered(self) -> ScalingConfig:
        if not self.min_size <= self.desired_size <= self.max_size:
            raise ValueError(
                f"needs minSize <= desiredSize <= maxSize, got {self.min_size}, {self.desired_size}, {self.max_size}"
            )
        return self


def _known_instance_types(types: list[str]) -> None:
    unknown = [t for t in types if t not in INSTANCE_FACTS]
    if unknown:
        raise ValueError(f"{unknown} not in the instance facts table (infra/instances.py), which sizes every pod; "
                         f"known: {', '.join(sorted(INSTANCE_FACTS))}")


class SystemNodeGroupConfig(_Camel):
    instance_types: list[str] = Field(default_factory=lambda: ["m7i.xlarge"], min_length=1)
    scaling: ScalingConfig = ScalingConfig(min_size=2, max_size=6, desired_size=3)

    @field_validator("instance_types")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        _known_instance_types(v)
        return v


class GpuNodeGroupConfig(_Camel):
    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$")
    instance_types: list[str] = Field(min_length=1)
    ami_type: GpuAmiType = "AL2023_x86_64_NVIDIA"
    gpus_per_node: int = Field(ge=1, le=16)
    scaling: ScalingConfig
    efa: bool = False
    disk_size_gib: int = Field(default=500, ge=MIN_IMAGE_VOLUME_GIB, le=16384)
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("instance_types")
    @classmethod
    def _gpu_instances(cls, v: list[str]) -> list[str]:
        for itype in v:
            if itype.split(".")[0] not in GPU_INSTANCE_FAMILIES:
                raise ValueError(f"{itype!r} is not an NVIDIA GPU instance type; allowed families: "
                                 f"{', '.join(GPU_INSTANCE_FAMILIES)}")
        _known_instance_types(v)
        return v

    @model_validator(mode="after")
    def _gpus_match_instance_types(self) -> GpuNodeGroupConfig:
        # Pods are sized as a share of one GPU of the pool's smallest type (infra.instances.pod_share): every type
        # must have exactly gpusPerNode GPUs, or the share (and the model's fit) would be wrong on some nodes.
        wrong = {t: INSTANCE_FACTS[t].gpus for t in self.instance_types if INSTANCE_FACTS[t].gpus != self.gpus_per_node}
        if wrong:
            raise ValueError(f"gpusPerNode: {self.gpus_per_node}, but {wrong} (GPUs per node of each instance type, "
                             f"infra/instances.py); a pool's instance types must all have gpusPerNode GPUs")
        return self

    @model_validator(mode="after")
    def _efa_capable(self) -> GpuNodeGroupConfig:
        if self.efa:
            bad = [t for t in self.instance_types if t.split(".")[0] not in EFA_INSTANCE_FAMILIES]
            if bad:
                raise ValueError(f"efa: true needs EFA-capable instance types ({', '.join(EFA_INSTANCE_FAMILIES)}),"
                                 f" got {bad}")
        return self

    @property
    def needs_device_plugin(self) -> bool:
        return self.ami_type in AMIS_WITHOUT_DEVICE_PLUGIN


# AMIs for CPU node groups: EKS-optimised, without the NVIDIA driver (there is no GPU to drive).
CpuAmiType = Literal["AL2023_x86_64_STANDARD", "AL2023_ARM_64_STANDARD", "BOTTLEROCKET_x86_64",
                     "BOTTLEROCKET_ARM_64"]


class CpuNodeGroupConfig(_Camel):
    """A node group without GPUs for the models that need none (a non-LLM model such as the XGBoost ranker, an
    ensemble of such models): a managed node group and a Karpenter NodePool like a GPU group's, without the GPU
    taint, labelled `llm-serving/cpu-node-group: <name>`."""

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$")
    instance_types: list[str] = Field(min_length=1)
    ami_type: CpuAmiType = "AL2023_x86_64_STANDARD"
    scaling: ScalingConfig
    # The serving image (Triton with vLLM) is the same on every model node: the same room for two of its versions.
    disk_size_gib: int = Field(default=200, ge=MIN_IMAGE_VOLUME_GIB, le=16384)
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("instance_types")
    @classmethod
    def _cpu_instances(cls, v: list[str]) -> list[str]:
        _known_instance_types(v)
        gpus = [t for t in v if t.split(".")[0] in GPU_INSTANCE_FAMILIES or INSTANCE_FACTS[t].gpus]
        if gpus:
            raise ValueError(f"{gpus} have GPUs; a CPU node group lists instance types without GPUs (GPU types "
                             f"belong in gpuNodeGroups)")
        return v


def _narrow_cidr(v: str, widest: int) -> str:
    import ipaddress

    net = ipaddress.ip_network(v, strict=True)
    if net.prefixlen < widest:
        raise ValueError(f"{v!r} is wider than /{widest}: name the runner's own addresses")
    return v


class ApiAccessConfig(_Camel):
    """How the update's runner reaches the Kubernetes API of the cluster this update creates (docs/first-update.md,
    "Reaching a private cluster")."""

    # A runner in the VPC, or in a network routed to it: TCP 443 to the private endpoint from these CIDRs.
    runner_cidrs: list[str] = Field(default_factory=list)
    # Only for the first update of a cluster in a VPC the same update creates: the public endpoint is on, restricted
    # to these CIDRs (the runner's egress addresses), until the next update, without this key, turns it off again.
    bootstrap_public_cidrs: list[str] = Field(default_factory=list)

    @field_validator("runner_cidrs")
    @classmethod
    def _runner(cls, v: list[str]) -> list[str]:
        return [_narrow_cidr(c, 16) for c in v]

    @field_validator("bootstrap_public_cidrs")
    @classmethod
    def _bootstrap(cls, v: list[str]) -> list[str]:
        return [_narrow_cidr(c, 24) for c in v]


class ClusterConfig(_Camel):
    api_access: ApiAccessConfig = ApiAccessConfig()
    kubernetes_version: str = Field(default="1.33", pattern=r"^1\.(2[89]|3\d)$")
    endpoint_public_access: bool = False
    system_node_group: SystemNodeGroupConfig = SystemNodeGroupConfig()
    gpu_node_groups: list[GpuNodeGroupConfig] = Field(min_length=1)
    cpu_node_groups: list[CpuNodeGroupConfig] = Field(default_factory=list)
    # "auto": install NVIDIA's device plugin for the node groups whose AMI lacks it; "never": the operator runs it.
    device_plugin: Literal["auto", "never"] = "auto"

    @model_validator(mode="after")
    def _unique_groups(self) -> ClusterConfig:
        names = [g.name for g in self.gpu_node_groups]
        dupes = repeated(names)
        if dupes:
            raise ValueError(f"gpuNodeGroups: duplicate names {dupes}")
        cpu = [g.name for g in self.cpu_node_groups]
        dupes = repeated(cpu)
        if dupes:
            raise ValueError(f"cpuNodeGroups: duplicate names {dupes}")
        both = sorted(set(names) & set(cpu))
        if both:
            raise ValueError(f"cpuNodeGroups: {both} also name GPU node groups; a node group name means one pool")
        return self


# -- model storage -----------------------------------------------------------------------------------------------


class FsxConfig(_Camel):
    # PERSISTENT_2 accepts 1200 GiB or multiples of 2400 GiB.
    storage_capacity_gib: int = Field(default=2400, ge=1200)
    per_unit_storage_throughput: Literal[125, 250, 500, 1000] = 250

    @field_validator("storage_capacity_gib")
    @classmethod
    def _capacity(cls, v: int) -> int:
        if v != 1200 and v % 2400:
            raise ValueError(f"PERSISTENT_2 takes 1200 GiB or a multiple of 2400 GiB, got {v}")
        return v


class ReplicaRegion(_Camel):
    """A region the home bucket replicates to, and the key that region's stack encrypts its bucket with (its
    `modelKmsKeyArn` output): replicas are encrypted with it, and IAM names it exactly."""

    region: str = Field(pattern=_REGION_RE)
    kms_key_arn: str = Field(pattern=r"^arn:aws:kms:[a-z0-9-]+:\d{12}:key/(mrk-[0-9a-f]{32}|[0-9a-f-]{36})$")

    @model_validator(mode="after")
    def _same_region(self) -> ReplicaRegion:
        if self.kms_key_arn.split(":")[3] != self.region:
            raise ValueError(f"kmsKeyArn: the key must be in {self.region}, got {self.kms_key_arn}")
        return self


class ModelStorageConfig(_Camel):
    # Bucket names are global: "<bucketPrefix>-<env>-<region>", the same rule in every stack, so the home region
    # can name its replication targets without reading other stacks.
    bucket_prefix: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{2,30}[a-z0-9]$")
    model_prefix: str = Field(default="models/", pattern=r"^[a-z0-9][a-z0-9/_-]*/$")
    noncurrent_version_days: int = Field(default=30, ge=1, le=3650)
    replica_regions: list[ReplicaRegion] = Field(default_factory=list)
    fsx: FsxConfig = FsxConfig()


# -- serving -----------------------------------------------------------------------------------------------------


class ServingConfig(_Camel):
    namespace: str = Field(default="llm-serving", pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    domain: str = Field(pattern=r"^([a-z0-9]([a-z0-9-]*[a-z0-9])?\.)+[a-z]{2,}$")
    gateway_class_name: str = "envoy-gateway"  # the class infra/bootstrap.py installs
    # Used only while serving_image/compat.toml does not exist yet (§3.9 makes that file the single source).
    triton_image_tag: str | None = Field(default=None, pattern=r"^\d{2}\.\d{2}-vllm-python-py3$")
    termination_grace_period_seconds: int = Field(default=120, ge=30, le=3600)
    prometheus_address: str = "http://prometheus-operated.monitoring.svc:9090"
    monitoring_namespace: str = Field(default="monitoring", pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    # The `release` label on the PodMonitor and PrometheusRule (infra/observability.py): kube-prometheus-stack's
    # Prometheus selects both by `release: <its Helm release name>` by default. null: no release label, for a
    # Prometheus whose podMonitorSelector and ruleSelector select everything.
    monitoring_release_label: str | None = Field(
        default="kube-prometheus-stack", max_length=63,
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")  # a Kubernetes label value, not empty
    target_queue_depth: int = Field(default=8, ge=1, le=1000)


# -- models ------------------------------------------------------------------------------------------------------


class PackageRef(_Camel):
    """A published package by (model id, version): `model-cache/<id>/<version>/` under the model prefix."""

    id: str = Field(pattern=_ID_RE)
    version: str = Field(pattern=_VERSION_RE)


class ModelVersion(_Camel):
    version: str = Field(pattern=_VERSION_RE)
    # The published package directory on the model cache,
    # `s3://<home bucket>/<modelPrefix>model-cache/<id>/<version>/` (llm_serving.pod_contract.package_uri, the key
    # `llm-serving publish` writes); its id is checked against the model's below. Its version is normally this
    # entry's, but a candidate that only changes the serving image names the active version's package (§4).
    package: str = Field(pattern=r"^s3://[a-z0-9][a-z0-9.-]+/.+/$")
    io_fingerprint: str = Field(pattern=_FINGERPRINT_RE)
    # A digest of the stack's serving image repository that this version keeps running (the `servingImage`
    # output of an earlier update). Without it the version runs the image this update builds. Pinning the active
    # version and adding a candidate with the same package is how a new serving image goes red-black (§4).
    image: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")
    # An ensemble's step models, served by the same Triton in the same pod (a Triton ensemble only calls models of
    # its own server): each a published package by (id, version), as the ensemble's manifest names them
    # ([ensemble] steps). Only for `kind: ensemble`.
    steps: list[PackageRef] = Field(default_factory=list)
    # The package's weights in GiB (its weights directory), the stack's declaration: the GPU memory check and the
    # model cache's load time use it, `llm-serving rollout` compares it with the published package. Required for a
    # vllm model (ModelConfig below), optional for the other kinds.
    weights_gib: float | None = Field(default=None, gt=0, le=16384)

    @field_validator("steps")
    @classmethod
    def _unique_steps(cls, v: list[PackageRef]) -> list[PackageRef]:
        ids = [s.id for s in v]
        dupes = repeated(ids)
        if dupes:
            raise ValueError(f"names the model(s) {dupes} twice; a server serves one version of each step model")
        return v


class GpuShape(_Camel):
    node_group: str
    count: int = Field(ge=1, le=16)


class AutoscalingConfig(_Camel):
    max_replicas: int = Field(ge=1, le=1000)
    target_queue_depth: int | None = Field(default=None, ge=1, le=1000)


# A model's kind: its packages' `model.backend` (llm_serving.manifest.Backend; docs/architecture.md §3.4, "Model
# kinds"): `vllm` (an LLM), `python` (a Python-backend model, e.g. the XGBoost ranker), `ensemble`.
ModelKind = Literal["vllm", "python", "ensemble"]
assert set(ModelKind.__args__) == {b.value for b in Backend}, "the stack's model kinds are the manifest's backends"


class ModelConfig(_Camel):
    id: str = Field(pattern=_ID_RE)
    kind: ModelKind
    replicas: int = Field(ge=1, le=500)
    # GPUs per pod and their node group; without it the model runs on the CPU node group `nodeGroup`.
    gpu: GpuShape | None = None
    node_group: str | None = None
    # A CPU model's pod gets 1/podsPerNode of what the smallest instance type of its node group leaves to pods.
    pods_per_node: int | None = Field(default=None, ge=1, le=64)
    strategy: Literal["red-black", "versioned"]
    versions: list[ModelVersion] = Field(min_length=1)
    active: str | None = None
    candidate: str | None = None
    weight: int | None = Field(default=None, ge=0, le=100)
    # The startupProbe's budget: how long the engine may take to load the weights from the model cache.
    load_time_seconds: int = Field(default=600, ge=30, le=7200)
    autoscaling: AutoscalingConfig | None = None
    # A vllm model's engine layout over its pod's GPUs (the packages' [engine.parallel], llm_serving.manifest):
    # t x p x d must equal gpu.count. Omitted: 1 x 1 x 1. Only for kind: vllm (other kinds run no engine).
    parallel: ParallelLayout | None = None
    # A vllm model's KV cache per pod, in GiB: what the engine must find in GPU memory beside the weights for the
    # context lengths and concurrency the model serves (vLLM refuses to start when max_model_len's cache does not
    # fit). The stack's declaration; required for kind: vllm, only for it.
    kv_cache_gib: float | None = Field(default=None, gt=0, le=16384)
    # A vllm model's tasks, as its packages' engine.tasks state them: each starts an engine of its own on the pod's
    # GPUs, loading the weights (serving_image/triton/models.py), so each is budgeted. Omitted: ["generate"].
    tasks: list[Literal["generate", "embed", "score"]] | None = None
    # What the model's packages import (their [python] dependencies, PEP 508 strings), stated again by the stack
    # because it names packages by URI only: the policy serving-python-dependencies-in-image checks them against the
    # image's stub pins (compat.toml [triton.stub]). Only for kind: python and ensemble (its steps' packages).
    python_dependencies: list[str] = Field(default_factory=list)
    # The caller's process may run this model from its published package (docs/clients.md, "In the caller's
    # process"): only a python model on a CPU node group; a GPU model or an LLM never runs in a client. Rendered as
    # the outputs' `inProcess`.
    in_process: bool = False

    @field_validator("python_dependencies")
    @classmethod
    def _check_python_dependencies(cls, v: list[str], info) -> list[str]:
        if v and info.data.get("kind") == "vllm":
            raise ValueError("only a python or ensemble model runs Python-backend packages; a vllm model's "
                             "dependencies are the image's")
        try:
            parse_requirements(v, "pythonDependencies")
        except DependencyError as exc:
            raise ValueError(str(exc)) from exc
        return v

    @model_validator(mode="after")
    def _placement_and_kind(self) -> ModelConfig:
        if self.gpu is not None:
            for key in ("node_group", "pods_per_node"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{_camel(key)}: a model with gpu names its node group in gpu.nodeGroup and is "
                                     f"sized by gpu.count; {_camel(key)} is only for a model without gpu")
        elif self.node_group is None:
            raise ValueError("nodeGroup: a model without gpu names the CPU node group it runs on "
                             "(cluster.cpuNodeGroups), or give gpu: {nodeGroup, count}")
        if self.kind == "vllm" and self.gpu is None:
            raise ValueError("gpu: a vllm model (an LLM) runs on GPUs (NVIDIA's vLLM backend); give gpu: "
                             "{nodeGroup, count}")
        if self.kind == "vllm" and self.gpu is not None and self.gpu.count != self.layout.gpus:
            raise ValueError(f"gpu.count: {self.gpu.count} GPUs per pod, but the engine's parallel layout is "
                             f"{self.layout.describe()}; vLLM uses exactly that many (declare parallel: {{tensor, "
                             f"pipeline, data}} as the packages' [engine.parallel] say, or change gpu.count)")
        if self.kind != "vllm" and self.parallel is not None:
            raise ValueError(f"parallel: only a vllm model runs an engine with a parallel layout; this model is "
                             f"kind: {self.kind}")
        if self.kind != "vllm" and self.gpus > 1:
            raise ValueError(f"gpu.count: a {self.kind} model's Triton instance uses one GPU (instance_group "
                             f"KIND_GPU); {self.gpus} GPUs per pod would leave {self.gpus - 1} idle")
        for j, v in enumerate(self.versions):
            if self.kind == "vllm" and v.io_fingerprint != VLLM_IO_FINGERPRINT:
                raise ValueError(f"versions[{j}].ioFingerprint: {v.io_fingerprint} is not the vLLM tensor contract's "
                                 f"({VLLM_IO_FINGERPRINT}), which every vllm package has "
                                 f"(llm_serving/tensor_contract.py); a package of another kind is not kind: vllm")
            if self.kind == "ensemble" and not v.steps:
                raise ValueError(f"versions[{j}].steps: an ensemble's pod serves its step models too; list each by "
                                 f"id and version (its manifest's [ensemble] steps)")
            if self.kind != "ensemble" and v.steps:
                raise ValueError(f"versions[{j}].steps: only an ensemble (kind: ensemble) serves step models; this "
                                 f"model is kind: {self.kind}")
            if any(s.id == self.id for s in v.steps):
                raise ValueError(f"versions[{j}].steps: {self.id!r} is the ensemble itself; a step is another "
                                 f"package")
        return self

    @model_validator(mode="after")
    def _in_process_only_on_cpu(self) -> ModelConfig:
        if self.in_process and (self.kind != "python" or self.gpu is not None):
            raise ValueError(f"inProcess: only a python model without gpu may run in the caller's process; this "
                             f"model is kind: {self.kind}{' with gpu' if self.gpu is not None else ''}")
        return self

    @model_validator(mode="after")
    def _tasks(self) -> ModelConfig:
        if self.tasks is None:
            return self
        if self.kind != "vllm":
            raise ValueError(f"tasks: only a vllm model starts engines per task; this model is kind: {self.kind}")
        try:
            VllmEngine(tasks=self.tasks)  # the manifest's rules: each task once, `score` only beside `generate`
        except ValidationError as err:
            raise ValueError(f"tasks: {err.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        return self

    @property
    def engine_tasks(self) -> tuple[str, ...]:
        """The tasks whose engines a vllm model's pod starts (none for another kind)."""
        if self.kind != "vllm":
            return ()
        return tuple(self.tasks or ["generate"])

    @model_validator(mode="after")
    def _sizes_declared(self) -> ModelConfig:
        if self.kind != "vllm":
            if self.kv_cache_gib is not None:
                raise ValueError(f"kvCacheGib: only a vllm model (an LLM engine) keeps a KV cache; this model is "
                                 f"kind: {self.kind}")
            return self
        if self.kv_cache_gib is None:
            raise ValueError("kvCacheGib: a vllm model declares the KV cache one pod needs, in GiB (checked with "
                             "each version's weightsGib against the GPU memory the pod gets)")
        for j, v in enumerate(self.versions):
            if v.weights_gib is None:
                raise ValueError(f"versions[{j}].weightsGib: a vllm model declares each version's weights size in "
                                 f"GiB (its package's weights directory): the GPU memory and the model cache's load "
                                 f"time are checked with it")
        return self

    @property
    def layout(self) -> ParallelLayout:
        """The engine's parallel layout the stack declares (1 x 1 x 1 when `parallel` is omitted)."""
        return self.parallel or ParallelLayout()

    @property
    def gpus(self) -> int:
        """GPUs per pod: 0 for a model on a CPU node group."""
        return self.gpu.count if self.gpu is not None else 0

    @property
    def placement(self) -> str:
        """The name of the node group the model's pods run on (a GPU group, or a CPU group without gpu)."""
        return self.gpu.node_group if self.gpu is not None else self.node_group  # type: ignore[return-value]

    @model_validator(mode="after")
    def _strategy_fields(self) -> ModelConfig:
        names = [v.version for v in self.versions]
        dupes = repeated(names)
        if dupes:
            raise ValueError(f"versions: duplicate versions {dupes}")
        if self.strategy == "versioned":
            for key in ("active", "candidate", "weight"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key}: only a red-black model names {key}; a versioned model serves every "
                                     f"listed version")
            return self
        if self.active is None:
            raise ValueError(f"active: a red-black model must name its active version, one of {names}")
        if self.active not in names:
            raise ValueError(f"active: {self.active!r} is not one of the listed versions {names}")
        if self.candidate is not None:
            if self.candidate not in names:
                raise ValueError(f"candidate: {self.candidate!r} is not one of the listed versions {names}")
            if self.candidate == self.active:
                raise ValueError(f"candidate: {self.candidate!r} is the active version; a candidate must differ")
            if self.weight is None:
                raise ValueError("weight: a red-black model with a candidate needs the candidate's weight (0-100)")
        elif self.weight is not None:
            raise ValueError("weight: only allowed together with candidate")
        served = {self.active, self.candidate}
        idle = [n for n in names if n not in served]
        if idle:
            raise ValueError(f"versions: {idle} are neither active nor candidate; a red-black model lists only the "
                             f"versions it serves")
        if self.autoscaling and self.autoscaling.max_replicas < self.replicas:
            raise ValueError(f"autoscaling.maxReplicas ({self.autoscaling.max_replicas}) is below replicas "
                             f"({self.replicas})")
        return self

    def version(self, name: str) -> ModelVersion:
        return next(v for v in self.versions if v.version == name)


# -- experiments ---------------------------------------------------------------------------------------------


class ArmConfig(_Camel):
    """One arm of an experiment (docs/clients.md, "Experiments"): a model of this stack, optionally one of its
    versions (only a versioned model, whose versions have their own endpoints), the request parameters the arm adds,
    its percent."""

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9_-]{0,30}[a-z0-9])?$")
    model: str = Field(pattern=_ID_RE)
    version: str | None = Field(default=None, pattern=_VERSION_RE)
    parameters: dict[str, Any] = Field(default_factory=dict)
    percent: float = Field(ge=0, le=100)


class ExperimentConfig(_Camel):
    """An A/B test the clients run: `unit` is what the assignment hashes (a user, a profile or a request id)."""

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?$")
    unit: Literal["user", "profile", "request"]
    arms: list[ArmConfig] = Field(min_length=2)

    @model_validator(mode="after")
    def _allocation(self) -> ExperimentConfig:
        names = [a.name for a in self.arms]
        dupes = repeated(names)
        if dupes:
            raise ValueError(f"arms: duplicate arm names {dupes}")
        total = sum(a.percent for a in self.arms)
        if abs(total - 100) > 1e-9:
            raise ValueError(f"arms: the percentages sum to {total:g}, not 100 "
                             f"({', '.join(f'{a.name}: {a.percent:g}' for a in self.arms)})")
        return self


def experiment_problems(experiment: ExperimentConfig, models: dict[str, ModelConfig]) -> list[tuple[int, str, str]]:
    """(arm index, sub-key, message) for every arm that names a model or version the stack does not serve, or pins a
    version of a red-black model. Here beside the schema because the policy experiments-arms-served states the same
    rules (policies import infra, never the reverse)."""
    problems = []
    for j, arm in enumerate(experiment.arms):
        model = models.get(arm.model)
        if model is None:
            problems.append((j, "model", f"{arm.model!r} is not a model of this stack (models: {sorted(models)})"))
        elif arm.version is not None:
            served = [v.version for v in model.versions]
            if model.strategy != "versioned":
                problems.append((j, "version", f"{arm.model!r} is red-black: one route serves {served} by rollout "
                                               f"weight, so an arm cannot pin {arm.version!r}; compare request "
                                               f"parameters, or serve the model versioned"))
            elif arm.version not in served:
                problems.append((j, "version", f"{arm.model!r} does not serve {arm.version!r} (served: {served})"))
    return problems


def _version_key(version: str):
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(version), version)
    except InvalidVersion:
        return (1, None, version)


def newest_version(model: ModelConfig) -> str:
    """The newest version: by PEP 440 order when every version parses (v1 < v2 < v10), else the last listed
    (versions are listed in the order they were published).

    Here, beside the schema, because both the rollout tool (infra.rollout.orchestrate: never removes it) and the
    policy pack (policies.rules.rollout: never scaled to zero) need the same answer, and policies import infra,
    never the reverse (the import-linter contracts in pyproject.toml)."""
    names = [v.version for v in model.versions]
    keys = [_version_key(n) for n in names]
    if all(k[0] == 0 for k in keys):
        return max(names, key=lambda n: _version_key(n)[1])
    return names[-1]


def active_version(model: ModelConfig) -> str:
    """The version a model's consumers get by default, and the one that is never removed or scaled to zero.
    Versioned: the newest (`newest_version`, whatever the listing order). Red-black: the version that carries the
    traffic, the `active` one, or the candidate once it has all of it (weight 100, before finalize); version
    numbers play no part, so a rollout back to a lower version completes.

    The stack outputs' `activeVersion` (infra.serving), the rollout tool's clean-up (infra.rollout.orchestrate) and
    the policy rollout-newest-version-kept (policies.rules.rollout) all take it from here."""
    if model.strategy == "versioned":
        return newest_version(model)
    if model.candidate is not None and model.weight == 100:
        return model.candidate
    return model.active  # type: ignore[return-value]  (a red-black model names its active version: the schema)


class StackConfig(_Camel):
    environment: Literal["dev", "prod"]
    team: str = Field(default="ml-platform", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")  # cost allocation tag/label
    region: str = Field(pattern=_REGION_RE)
    home_region: str = Field(pattern=_REGION_RE)
    network: NetworkConfig = NetworkConfig()
    cluster: ClusterConfig
    model_storage: ModelStorageConfig
    serving: ServingConfig
    models: list[ModelConfig] = Field(default_factory=list)
    experiments: list[ExperimentConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _experiments_served(self) -> StackConfig:
        names = [e.name for e in self.experiments]
        dupes = repeated(names)
        if dupes:
            raise ValueError(f"experiments: duplicate experiment names {dupes}")
        models = {m.id: m for m in self.models}
        for i, experiment in enumerate(self.experiments):
            for j, key, message in experiment_problems(experiment, models):
                raise ValueError(f"experiments[{i}].arms[{j}].{key}: {message}")
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> StackConfig:
        if self.environment == "prod" and self.cluster.endpoint_public_access:
            raise ValueError("cluster.endpointPublicAccess: prod clusters have a private endpoint only "
                             "(allowed: false)")
        ids = [m.id for m in self.models]
        dupes = repeated(ids)
        if dupes:
            raise ValueError(f"models: duplicate model ids {dupes}")
        groups = {g.name: g for g in self.cluster.gpu_node_groups}
        cpu_groups = {g.name: g for g in self.cluster.cpu_node_groups}
        for i, model in enumerate(self.models):
            if model.gpu is None:
                if model.node_group in groups:
                    raise ValueError(f"models[{i}].nodeGroup: {model.node_group!r} is a GPU node group; a model "
                                     f"without gpu runs on a CPU node group (cluster.cpuNodeGroups: "
                                     f"{sorted(cpu_groups) or 'none'})")
                if model.node_group not in cpu_groups:
                    raise ValueError(f"models[{i}].nodeGroup: {model.node_group!r} is not a CPU node group; "
                                     f"allowed: {sorted(cpu_groups) or 'none (add cluster.cpuNodeGroups)'}")
                continue
            group = groups.get(model.gpu.node_group)
            if group is None:
                hint = " (a CPU node group; a model with gpu runs on a GPU node group)" if (
                    model.gpu.node_group in cpu_groups) else ""
                raise ValueError(f"models[{i}].gpu.nodeGroup: {model.gpu.node_group!r} is not a GPU node group"
                                 f"{hint}; allowed: {sorted(groups)}")
            if model.gpu.count > group.gpus_per_node:
                raise ValueError(f"models[{i}].gpu.count: {model.gpu.count} GPUs do not fit on one node of "
                                 f"{group.name!r} ({group.gpus_per_node} GPUs per node)")
        home_bucket, prefix = self.bucket_name(self.home_region), self.model_storage.model_prefix
        for i, model in enumerate(self.models):
            for j, v in enumerate(model.versions):
                bucket, _, key = v.package.removeprefix("s3://").partition("/")
                if bucket != home_bucket or not key.startswith(prefix):
                    raise ValueError(f"models[{i}].versions[{j}].package: {v.package!r} must be under "
                                     f"s3://{home_bucket}/{prefix} (packages are published once in the home region "
                                     f"and replicated to the others)")
                try:
                    _, package_id, _ = parse_package_uri(v.package, prefix)
                except PodContractError:
                    package_id = None
                if package_id != model.id:
                    expected = package_uri(home_bucket, prefix, model.id, v.version)
                    raise ValueError(f"models[{i}].versions[{j}].package: {v.package!r} is not where "
                                     f"`llm-serving publish --store s3://{home_bucket}/{prefix.rstrip('/')}` puts a "
                                     f"package of {model.id}; expected {expected!r} for {model.id} {v.version} (the "
                                     f"unpacked package on the model cache, read in place by the pods)")
        if self.region != self.home_region and self.model_storage.replica_regions:
            raise ValueError(f"modelStorage.replicaRegions: only the home region ({self.home_region}) replicates")
        if self.region in [r.region for r in self.model_storage.replica_regions]:
            raise ValueError(f"modelStorage.replicaRegions: {self.region} is this stack's own region")
        return self

    @model_validator(mode="after")
    def _sizes_fit(self) -> StackConfig:
        """Each version's weights and the model's KV cache fit the GPUs' memory of the pool's smallest-GPU type, and
        its weights can be read from the model cache within loadTimeSeconds (infra.model_fit)."""
        fsx = self.model_storage.fsx
        for i, model in enumerate(self.models):
            sized = [(j, v) for j, v in enumerate(model.versions) if v.weights_gib is not None]
            if model.gpu is not None:
                group = self.node_group(model)
                tasks = model.engine_tasks
                utilization = engine_budget(tasks) if model.kind == "vllm" else OTHER_GPU_MEMORY_UTILIZATION
                for j, v in sized:
                    fit = gpu_memory_fit(group.instance_types, model.gpu.count, v.weights_gib,
                                         model.kv_cache_gib or 0.0, utilization, tasks)
                    if not fit.fits:
                        last = (", a smaller kvCacheGib or fewer tasks" if len(tasks) > 1
                                else ", or a smaller kvCacheGib")
                        raise ValueError(f"models[{i}].versions[{j}].weightsGib: {model.id} {v.version} does not fit "
                                         f"its pod's GPUs: {fit.describe()}; give it more GPUs (gpu.count), a pool "
                                         f"with more GPU memory{last}")
            # The most pods that read one version's weights at once: a red-black candidate, or a new version of a
            # versioned model, starts all its replicas together, and KEDA may have scaled the model to maxReplicas.
            pods = max(model.replicas, model.autoscaling.max_replicas if model.autoscaling else 0)
            for _, v in sized:
                load = LoadTime(v.weights_gib, pods, fsx.storage_capacity_gib, fsx.per_unit_storage_throughput,
                                model.load_time_seconds)
                if not load.fits:
                    raise ValueError(f"models[{i}].loadTimeSeconds: {model.id} {v.version}: {load.describe()}; the "
                                     f"startup probe would restart the pods before they are ready. Raise "
                                     f"loadTimeSeconds or the model cache's throughput (modelStorage.fsx)")
        self._resident_versions_fit()
        return self

    def _resident_versions_fit(self) -> None:
        """The model cache holds every package the stack names resident (the cache warmer restores each in full, and
        nothing releases one a version still serves), plus room to warm the next version of the largest model before
        a rollout may name it (docs/first-update.md, "A warm model cache")."""
        sizes = {v.package: v.weights_gib for m in self.models for v in m.versions if v.weights_gib is not None}
        if not sizes:
            return
        resident, incoming = sum(sizes.values()), max(sizes.values())
        capacity = self.model_storage.fsx.storage_capacity_gib
        if resident + incoming > capacity:
            raise ValueError(f"modelStorage.fsx.storageCapacityGib: {capacity} GiB cannot hold the {len(sizes)} "
                             f"package(s) this stack serves resident ({resident:g} GiB of weightsGib) plus the next "
                             f"version of the largest ({incoming:g} GiB) warmed before its rollout: "
                             f"{resident + incoming:g} GiB needed")

    def node_group(self, model: ModelConfig) -> GpuNodeGroupConfig | CpuNodeGroupConfig:
        """The node group a (validated) model runs on."""
        groups = self.cluster.gpu_node_groups if model.gpu is not None else self.cluster.cpu_node_groups
        return next(g for g in groups if g.name == model.placement)

    def regional_package_uri(self, package: str) -> str:
        """A package's URI in this region's model bucket: the home bucket's key, replicated under the same key."""
        _, _, key = package.removeprefix("s3://").partition("/")
        return f"s3://{self.bucket_name()}/{key}"

    @property
    def is_home_region(self) -> bool:
        return self.region == self.home_region

    def bucket_name(self, region: str | None = None) -> str:
        return f"{self.model_storage.bucket_prefix}-{self.environment}-{region or self.region}"


# -- compat pins -------------------------------------------------------------------------------------------------


class TritonPin(_Strict):
    """The serving image's base and what it pins (§3.9): from serving_image/compat.toml when it exists, else from
    `serving.tritonImageTag` (only until that file exists; both at once must agree)."""

    image: str  # the Triton base image, e.g. nvcr.io/nvidia/tritonserver:26.08-vllm-python-py3
    image_tag: str
    release: str
    vllm_version: str | None
    vllm_backend_branch: str | None
    source: str


TRITON_REPOSITORY = "nvcr.io/nvidia/tritonserver"


def triton_pin(serving: ServingConfig, compat_path: Path = COMPAT_TOML) -> TritonPin:
    if compat_path.is_file():
        try:
            triton = load_compat(compat_path).triton  # the one reader (llm_serving/compat.py) checks every key
        except CompatError as exc:
            raise ConfigError(str(exc)) from None
        image, tag, release = triton.image, triton.image_tag, triton.release
        if serving.triton_image_tag and serving.triton_image_tag != tag:
            raise ConfigError(f"{PROJECT}:serving.tritonImageTag: {serving.triton_image_tag!r} disagrees with "
                              f"{compat_path.name} ({tag!r}); remove the key, compat.toml is the single pin")
        source = str(compat_path.relative_to(REPO_ROOT)) if compat_path.is_relative_to(REPO_ROOT) else str(compat_path)
        return TritonPin(image=image, image_tag=tag, release=release, vllm_version=triton.vllm_version,
                         vllm_backend_branch=triton.vllm_backend_branch, source=source)
    if not serving.triton_image_tag:
        raise ConfigError(f"{PROJECT}:serving.tritonImageTag: required while serving_image/compat.toml does not "
                          f"exist (allowed: a Triton NGC tag like '26.08-vllm-python-py3')")
    tag = serving.triton_image_tag
    return TritonPin(image=f"{TRITON_REPOSITORY}:{tag}", image_tag=tag, release=tag[:5], vllm_version=None,
                     vllm_backend_branch=None, source=f"{PROJECT}:serving.tritonImageTag")


# -- parsing -----------------------------------------------------------------------------------------------------


def _loc(loc: tuple[Any, ...]) -> str:
    out = PROJECT
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += (":" if i == 0 else ".") + str(part)
    return out


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        # Errors raised by model validators carry the offending sub-key first in their message ("active: ...").
        loc = tuple(p for p in item["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal["))))
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            msg = "unknown key (not part of the stack config schema)"
        elif "input" in item and item["type"] not in ("missing",) and not isinstance(item["input"], dict | list):
            msg += f" (got {item['input']!r})"
        head, sep, rest = msg.partition(": ")
        if sep and re.fullmatch(r"[A-Za-z][\w.\[\]]*", head):
            loc = loc + tuple(re.split(r"\.(?![^\[]*\])", head))
            msg = rest
        lines.append(f"{_loc(loc)}: {msg}")
    return "\n".join(lines)


def parse_stack_config(values: dict[str, Any], region: str) -> StackConfig:
    """Validate the project's config values (keys without the `llm-serving:` prefix, values already decoded)."""
    unknown = sorted(set(values) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ConfigError("\n".join(f"{PROJECT}:{k}: unknown key (allowed: {', '.join(TOP_LEVEL_KEYS)})"
                                    for k in unknown))
    try:
        return StackConfig.model_validate({**values, "region": region})
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def from_pulumi_config() -> StackConfig:
    """Read and validate the running stack's config through Pulumi's config API."""
    import pulumi
    from pulumi.runtime import config as runtime_config

    # The engine hands config either through the environment or through set_all_config (mocks, newer hosts).
    raw = {**runtime_config.get_config_env(), **runtime_config.CONFIG.get()}
    values: dict[str, Any] = {}
    prefix = f"{PROJECT}:"
    for key, value in dict(raw).items():
        if key.startswith(prefix):
            name = key[len(prefix):]
            values[name] = _decode(name, value)
    region = pulumi.Config("aws").get("region")
    if not region:
        raise ConfigError("aws:region: required (the stack's AWS region, e.g. us-east-1)")
    return parse_stack_config(values, region)


def _decode(name: str, value: str) -> Any:
    """Pulumi hands structured values as JSON and plain ones as strings; a plain string where the schema wants an
    object is then reported by the schema, under its key."""
    if name in ("environment", "homeRegion", "team"):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
