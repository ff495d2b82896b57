"""Capacity: every model pod fits every instance type its pool (GPU or CPU node group) may launch.

A pod whose requests exceed what a node leaves to pods is never scheduled on that node: with a pool of several
types (a managed node group's `instanceTypes`, a Karpenter NodePool's instance-type requirement) the scheduler or
the autoscaler may pick the one it does not fit, and the pod waits forever. The pool of a model pod is the value of
its `nodeSelector` on `llm-serving/gpu-node-group` (a model with GPUs) or `llm-serving/cpu-node-group` (a model
without); the pools are the node groups and NodePools that label their nodes with it.

What a node of a type leaves to pods is computed here, by the kubelet's numbers, from the instance table's data
columns only (`infra/instances.py`: vCPUs, GPUs, and NODE_CAPACITY's memory capacity as the kubelet reports it and
max pods): the kubelet's reservation formulas are restated below rather than taken from `infra.instances`'
`allocatable` or `pod_share`, the code that sized the pods, so a bug in the sizing (nominal memory, a reservation
left out) shows up here instead of agreeing with itself. Types the table lacks are not sized here: the
approved-instance-types rules refuse them, and a test keeps every approved type in the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pulumi_policy import EnforcementLevel, ReportViolation, StackValidationArgs, StackValidationPolicy

from infra.instances import DAEMONSET_CPU_MILLIS, DAEMONSET_MEMORY_MIB, INSTANCE_FACTS, NODE_CAPACITY, parse_quantity
from infra.naming import CPU_NODE_GROUP_LABEL, GPU_NODE_GROUP_LABEL

from .._props import as_list, get, iter_mappings, k8s_name
from ..index import StackIndex, is_serving_workload
from ..workload import DEPLOYMENT, GPU_RESOURCE, containers, pod_spec

NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
INSTANCE_TYPE_KEY = "node.kubernetes.io/instance-type"
POOL_LABELS = (GPU_NODE_GROUP_LABEL, CPU_NODE_GROUP_LABEL)


def pool_of(props: Mapping[str, Any]) -> tuple[str, str] | None:
    """(label, pool name) a model pod's nodeSelector selects: its GPU node group, else its CPU node group."""
    selector = pod_spec(props).get("nodeSelector") or {}
    for label in POOL_LABELS:
        if selector.get(label):
            return label, str(selector[label])
    return None


def pools(index: StackIndex, label: str = GPU_NODE_GROUP_LABEL) -> dict[str, list[str]]:
    """Pool name -> every instance type the pool may launch (managed node groups and Karpenter NodePools that
    label their nodes `label`: the GPU pools, or with CPU_NODE_GROUP_LABEL the CPU pools)."""
    found: dict[str, list[str]] = {}
    for group in index.of_type(NODE_GROUP):
        name = (get(group.props, "labels") or {}).get(label)
        if name:
            found.setdefault(name, []).extend(str(t) for t in as_list(get(group.props, "instanceTypes")))
    for pool in index.k8s("NodePool"):
        name = (get(pool.props, "spec", "template", "metadata", "labels") or {}).get(label)
        if not name:
            continue
        types = found.setdefault(name, [])
        for req in iter_mappings(get(pool.props, "spec", "template", "spec", "requirements")):
            if get(req, "key") == INSTANCE_TYPE_KEY and get(req, "operator") == "In":
                types.extend(str(t) for t in as_list(get(req, "values")))
    return found


def pod_needs(props: Mapping[str, Any]) -> dict[str, float]:
    """The pod's requests (CPU cores, memory bytes, GPUs) and its memory limit: the containers' sum, or the largest
    init container's when that is larger (Kubernetes' effective request)."""
    def total(cs, section: str, resource: str) -> float:
        return sum(parse_quantity(v) for c in cs if (v := get(c, "resources", section, resource)) is not None)

    main, init = containers(props), list(iter_mappings(pod_spec(props).get("initContainers")))
    needs = {}
    for key, section, resource in (("cpu", "requests", "cpu"), ("memory", "requests", "memory"),
                                   ("gpus", "limits", GPU_RESOURCE), ("memory_limit", "limits", "memory")):
        needs[key] = max([total(main, section, resource), *(total([c], section, resource) for c in init)])
    return needs


# The kubelet's reservations on EKS (AL2023's nodeadm, Bottlerocket, Karpenter's simulation): kube-reserved memory
# from the node's max pods, kube-reserved CPU from its cores, the hard eviction threshold on memory.available.
EVICTION_HARD_MIB = 100


def _kube_reserved_memory_mib(max_pods: int) -> int:
    return 255 + 11 * max_pods


def _kube_reserved_cpu_millis(vcpus: int) -> float:
    # 6% of the first core, 1% of the second, 0.5% of the third and fourth, 0.25% of every further one.
    shares = [(1, 60.0), (1, 10.0), (2, 5.0), (max(0, vcpus - 4), 2.5)]
    left, reserved = vcpus, 0.0
    for cores, millis in shares:
        used = min(left, cores)
        reserved, left = reserved + used * millis, left - used
    return reserved


@dataclass(frozen=True)
class NodeRoom:
    """What a node of one type leaves to the model pods, with the figures it comes from (for the messages)."""

    instance_type: str
    cpu_millis: float
    memory_mib: int
    gpus: int
    capacity_mib: int
    kube_reserved_mib: int

    def memory_basis(self) -> str:
        return (f"kubelet memory capacity {self.capacity_mib} MiB (infra/instances.py NODE_CAPACITY) - kube-reserved "
                f"{self.kube_reserved_mib} MiB - eviction {EVICTION_HARD_MIB} MiB - DaemonSets "
                f"{DAEMONSET_MEMORY_MIB} MiB = {self.memory_mib} MiB")


def node_room(instance_type: str) -> NodeRoom:
    f, node = INSTANCE_FACTS[instance_type], NODE_CAPACITY[instance_type]
    reserved = _kube_reserved_memory_mib(node.max_pods)
    memory = node.kubelet_memory_mib - reserved - EVICTION_HARD_MIB - DAEMONSET_MEMORY_MIB
    cpu = f.vcpus * 1000 - _kube_reserved_cpu_millis(f.vcpus) - DAEMONSET_CPU_MILLIS
    return NodeRoom(instance_type, cpu, memory, f.gpus, node.kubelet_memory_mib, reserved)


def _gib(mib: float) -> str:
    return f"{mib / 1024:.2f} GiB"


def _shortfalls(needs: dict[str, float], node: NodeRoom) -> list[str]:
    out = []
    if needs["cpu"] * 1000 > node.cpu_millis + 1e-6:
        out.append(f"{needs['cpu']:g} CPU requested, {node.cpu_millis / 1000:g} allocatable")
    room = f"{_gib(node.memory_mib)} allocatable ({node.memory_basis()})"
    if needs["memory"] > node.memory_mib * 2**20:
        out.append(f"{_gib(needs['memory'] / 2**20)} memory requested, {room}")
    if needs["memory_limit"] > node.memory_mib * 2**20:
        out.append(f"memory limit {_gib(needs['memory_limit'] / 2**20)} above {room}")
    if needs["gpus"] > node.gpus:
        out.append(f"{needs['gpus']:g} GPUs requested, the node has {node.gpus}")
    return out


def _validate_fit(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    by_label = {label: pools(index, label) for label in POOL_LABELS}
    for deployment in index.of_type(DEPLOYMENT):
        if not is_serving_workload(deployment.props):
            continue
        name = k8s_name(deployment.props) or deployment.name
        selected = pool_of(deployment.props)
        if not selected:
            report(f"model server {name!r} has no nodeSelector on {GPU_NODE_GROUP_LABEL} (or, without GPUs, "
                   f"{CPU_NODE_GROUP_LABEL}): it may land on any node type, so its fit cannot be known; select its "
                   f"pool", deployment.urn)
            continue
        label, pool = selected
        by_pool = by_label[label]
        if pool not in by_pool:
            kind = "GPU" if label == GPU_NODE_GROUP_LABEL else "CPU"
            report(f"model server {name!r} selects {kind} pool {pool!r}, but no node group or NodePool of this stack "
                   f"launches nodes labelled {label}={pool}", deployment.urn)
            continue
        types = by_pool[pool]  # a pool without visible types: gpu-nodes-approved-instance-types reports it
        needs = pod_needs(deployment.props)
        for itype in dict.fromkeys(types):
            if itype not in INSTANCE_FACTS or itype not in NODE_CAPACITY:
                continue
            short = _shortfalls(needs, node_room(itype))
            if short:
                report(f"model server {name!r} does not fit a {itype} node of pool {pool!r}, which the pool may "
                       f"launch ({'; '.join(short)}): it can never be scheduled there (and Karpenter's simulation, "
                       f"which assumes no more memory, never launches one for it). Size the pod from the pool's "
                       f"smallest type (infra.instances.pod_share) or drop the type from the pool", deployment.urn)


model_pod_fits_nodes = StackValidationPolicy(
    name="model-pod-fits-nodes",
    description="Every model pod's requests and limits fit every instance type its pool (GPU or CPU node group) "
                "may launch.",
    validate=_validate_fit,
    enforcement_level=EnforcementLevel.MANDATORY,
)

POLICIES = [model_pod_fits_nodes]
