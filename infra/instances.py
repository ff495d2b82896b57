"""The one table of EC2 instance facts the program, the stack schema and the policies size pods from.

Every instance type a stack's node groups or an autoscaler pool may launch must be listed here: the stack schema
(`infra.config`) refuses an unknown type, `infra.serving` derives each model pod's requests and limits from the
smallest type of its GPU pool, and the `model-pod-fits-nodes` policy checks every serving pod against every type
its pool may launch. No Pulumi import: the schema, the rollout tool and the policies use it without the runtime.

What a pod can get is the node's *allocatable* capacity, not its nominal size:

    capacity    = the memory the node's kubelet reports (status.capacity.memory, the kernel's MemTotal): below the
                  nominal size by what the hypervisor, the firmware and the kernel keep (NODE_CAPACITY)
    allocatable = capacity - kube-reserved - eviction threshold (the kubelet's own, EKS's formulas)
    for models  = allocatable - DAEMONSET_BUDGET (vpc-cni, kube-proxy, pod identity agent, FSx CSI node, device
                  plugin, node exporter: every DaemonSet a GPU node runs)

EKS computes kube-reserved from the node's max pods (memory: 255 MiB + 11 MiB per pod) and its cores (CPU: 6% of
the first core, 1% of the second, 0.5% of the next two, 0.25% of the rest). Max pods is the type's ENI limit, as
the EKS AMIs (AL2023's nodeadm, AL2's bootstrap) and Karpenter's scheduling simulation give it to the kubelet
(NODE_CAPACITY's `max_pods`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceFacts:
    vcpus: int
    memory_gib: int
    gpus: int = 0
    gpu_memory_gib: int = 0  # per GPU
    gpu: str | None = None  # the GPU model, for messages and docs


@dataclass(frozen=True)
class Allocatable:
    """What a node of one instance type leaves to the pods the program schedules on it (after DaemonSets)."""

    cpu_millis: int
    memory_mib: int
    gpus: int


# vCPUs, memory (GiB), GPUs, GPU memory (GiB per GPU): AWS's instance type pages (EC2 accelerated computing and
# general purpose). Changing or adding a row is a reviewed change; tests check every shipped type is here.
INSTANCE_FACTS: dict[str, InstanceFacts] = {
    # CPU: system node groups, and CPU node groups for models without GPUs (compute optimised c7i).
    "m7i.large": InstanceFacts(2, 8),
    "m7i.xlarge": InstanceFacts(4, 16),
    "m7i.2xlarge": InstanceFacts(8, 32),
    "m7i.4xlarge": InstanceFacts(16, 64),
    "c7i.xlarge": InstanceFacts(4, 8),
    "c7i.2xlarge": InstanceFacts(8, 16),
    "c7i.4xlarge": InstanceFacts(16, 32),
    # NVIDIA A10G (24 GB).
    "g5.xlarge": InstanceFacts(4, 16, 1, 24, "A10G"),
    "g5.2xlarge": InstanceFacts(8, 32, 1, 24, "A10G"),
    "g5.4xlarge": InstanceFacts(16, 64, 1, 24, "A10G"),
    "g5.8xlarge": InstanceFacts(32, 128, 1, 24, "A10G"),
    "g5.12xlarge": InstanceFacts(48, 192, 4, 24, "A10G"),
    "g5.48xlarge": InstanceFacts(192, 768, 8, 24, "A10G"),
    # NVIDIA L4 (24 GB).
    "g6.xlarge": InstanceFacts(4, 16, 1, 24, "L4"),
    "g6.2xlarge": InstanceFacts(8, 32, 1, 24, "L4"),
    "g6.4xlarge": InstanceFacts(16, 64, 1, 24, "L4"),
    "g6.12xlarge": InstanceFacts(48, 192, 4, 24, "L4"),
    # NVIDIA L40S (48 GB).
    "g6e.xlarge": InstanceFacts(4, 32, 1, 48, "L40S"),
    "g6e.2xlarge": InstanceFacts(8, 64, 1, 48, "L40S"),
    "g6e.4xlarge": InstanceFacts(16, 128, 1, 48, "L40S"),
    "g6e.12xlarge": InstanceFacts(48, 384, 4, 48, "L40S"),
    "g6e.24xlarge": InstanceFacts(96, 768, 4, 48, "L40S"),
    "g6e.48xlarge": InstanceFacts(192, 1536, 8, 48, "L40S"),
    # NVIDIA A100 (40 / 80 GB), H100 (80 GB), H200 (141 GB).
    "p4d.24xlarge": InstanceFacts(96, 1152, 8, 40, "A100"),
    "p4de.24xlarge": InstanceFacts(96, 1152, 8, 80, "A100"),
    "p5.48xlarge": InstanceFacts(192, 2048, 8, 80, "H100"),
    "p5e.48xlarge": InstanceFacts(192, 2048, 8, 141, "H200"),
    "p5en.48xlarge": InstanceFacts(192, 2048, 8, 141, "H200"),
}


@dataclass(frozen=True)
class NodeCapacity:
    """What a node of one type tells Kubernetes: its memory capacity (MiB) and the max pods its kubelet is given."""

    kubelet_memory_mib: int  # the capacity pods are sized from: min(measured_mib, the rule's figure)
    max_pods: int  # the ENI limit, awslabs/amazon-eks-ami templates/shared/runtime/eni-max-pods.txt
    measured_mib: int | None  # a published measurement of status.capacity.memory, when one exists
    source: str  # where kubelet_memory_mib comes from


# Karpenter's default `vmMemoryOverheadPercent`: its scheduling simulation takes a type's memory capacity to be
# nominal - ceil(nominal x 0.075) MiB. A pod sized above that never gets a node from a Karpenter NodePool (the
# simulation finds no type it fits), even where the real node would hold it; below it, it fits both.
KARPENTER_VM_MEMORY_OVERHEAD = 0.075


def karpenter_memory_mib(nominal_gib: int) -> int:
    """The memory capacity Karpenter's simulation assumes for a type of `nominal_gib` (its default overhead)."""
    nominal = nominal_gib * 1024
    return nominal - math.ceil(nominal * KARPENTER_VM_MEMORY_OVERHEAD)


RULE_ONLY = ("rule, no measured source: nominal - 7.5% (Karpenter's default vmMemoryOverheadPercent), rounded down "
             "to a MiB")
KARPENTER_MEASURED = ("measured: karpenter-provider-aws pkg/providers/instancetype/zz_generated.memory_overhead.go "
                      "(EC2's MemoryInfo minus the Node's status.capacity.memory on Bottlerocket, the AMI with the "
                      "largest overhead; hack/code/memory_overhead_gen.go); above the rule, so the rule's figure")
P4D_UNMEASURED = ("rule, no measured source: zz_generated.memory_overhead.go's p4d.24xlarge row is the whole 1152 GiB "
                  "(its generator's node never registered, so it measured nothing)")

# Memory capacity as Kubernetes sees it, per type: a reviewed table, never above Karpenter's rule (so a pod sized
# from it also fits what Karpenter's simulation assumes) and never above a published measurement. Nominal memory
# (INSTANCE_FACTS) stays for the docs; nothing sizes a pod from it. tests/infra/test_infra_capacity.py recomputes
# every row from its measurement and the rule.
NODE_CAPACITY: dict[str, NodeCapacity] = {
    "m7i.large": NodeCapacity(7577, 29, None, RULE_ONLY),
    "m7i.xlarge": NodeCapacity(15155, 58, None, RULE_ONLY),
    "m7i.2xlarge": NodeCapacity(30310, 58, None, RULE_ONLY),
    "m7i.4xlarge": NodeCapacity(60620, 234, None, RULE_ONLY),
    "c7i.xlarge": NodeCapacity(7577, 58, None, RULE_ONLY),
    "c7i.2xlarge": NodeCapacity(15155, 58, None, RULE_ONLY),
    "c7i.4xlarge": NodeCapacity(30310, 234, None, RULE_ONLY),
    "g5.xlarge": NodeCapacity(15155, 58, 15794, KARPENTER_MEASURED),
    "g5.2xlarge": NodeCapacity(30310, 58, 31729, KARPENTER_MEASURED),
    "g5.4xlarge": NodeCapacity(60620, 234, 63600, KARPENTER_MEASURED),
    "g5.8xlarge": NodeCapacity(121241, 234, 127436, KARPENTER_MEASURED),
    "g5.12xlarge": NodeCapacity(181862, 737, 191178, KARPENTER_MEASURED),
    "g5.48xlarge": NodeCapacity(727449, 345, 765880, KARPENTER_MEASURED),
    "g6.xlarge": NodeCapacity(15155, 58, None, RULE_ONLY),
    "g6.2xlarge": NodeCapacity(30310, 58, None, RULE_ONLY),
    "g6.4xlarge": NodeCapacity(60620, 234, None, RULE_ONLY),
    "g6.12xlarge": NodeCapacity(181862, 234, None, RULE_ONLY),
    "g6e.xlarge": NodeCapacity(30310, 58, None, RULE_ONLY),
    "g6e.2xlarge": NodeCapacity(60620, 58, None, RULE_ONLY),
    "g6e.4xlarge": NodeCapacity(121241, 234, None, RULE_ONLY),
    "g6e.12xlarge": NodeCapacity(363724, 292, None, RULE_ONLY),
    "g6e.24xlarge": NodeCapacity(727449, 492, None, RULE_ONLY),
    "g6e.48xlarge": NodeCapacity(1454899, 492, None, RULE_ONLY),
    "p4d.24xlarge": NodeCapacity(1091174, 737, None, P4D_UNMEASURED),
    "p4de.24xlarge": NodeCapacity(1091174, 737, None, RULE_ONLY),
    "p5.48xlarge": NodeCapacity(1939865, 100, None, RULE_ONLY),
    "p5e.48xlarge": NodeCapacity(1939865, 100, None, RULE_ONLY),
    "p5en.48xlarge": NodeCapacity(1939865, 198, None, RULE_ONLY),
}

EVICTION_HARD_MIB = 100
# The least a node's image volume (AL2023's root, Bottlerocket's data volume) may be: the Triton+vLLM serving image
# is tens of GB unpacked, and an image rollout holds the old and the new one. The schema's diskSizeGib minimum.
MIN_IMAGE_VOLUME_GIB = 100
DAEMONSET_CPU_MILLIS = 1000
DAEMONSET_MEMORY_MIB = 2048


class UnknownInstanceType(KeyError):
    pass


def facts(instance_type: str) -> InstanceFacts:
    try:
        return INSTANCE_FACTS[instance_type]
    except KeyError:
        raise UnknownInstanceType(
            f"{instance_type!r} is not in the instance facts table (infra/instances.py); known: "
            f"{', '.join(sorted(INSTANCE_FACTS))}") from None


def node_capacity(instance_type: str) -> NodeCapacity:
    facts(instance_type)  # an unknown type: the facts table's error, which lists the known types
    return NODE_CAPACITY[instance_type]


def kube_reserved_cpu_millis(vcpus: int) -> int:
    reserved = 60.0 + (10.0 if vcpus > 1 else 0.0) + 5.0 * max(0, min(vcpus, 4) - 2) + 2.5 * max(0, vcpus - 4)
    return math.ceil(reserved)


def kube_reserved_memory_mib(max_pods: int) -> int:
    return 255 + 11 * max_pods


def allocatable(instance_type: str) -> Allocatable:
    """What pods other than the node's DaemonSets can request on one node of this type: from the memory the
    kubelet reports (NODE_CAPACITY), never the nominal size."""
    f, node = facts(instance_type), node_capacity(instance_type)
    cpu = f.vcpus * 1000 - kube_reserved_cpu_millis(f.vcpus) - DAEMONSET_CPU_MILLIS
    memory = (node.kubelet_memory_mib - kube_reserved_memory_mib(node.max_pods) - EVICTION_HARD_MIB
              - DAEMONSET_MEMORY_MIB)
    return Allocatable(cpu_millis=cpu, memory_mib=memory, gpus=f.gpus)


@dataclass(frozen=True)
class PodShare:
    """A model pod's requests (and its memory limit, equal to the request) for `gpus` GPUs of a pool."""

    cpu_millis: int
    memory_mib: int
    gpus: int

    def resources(self) -> dict[str, dict[str, str]]:
        """The container's `resources`: CPU and memory requests, memory limited to the request (a model server
        that grows past its share would take the memory of the node's other GPUs' pods), no CPU limit (CFS
        throttling stalls the engine's scheduler loop; requests already reserve the cores)."""
        requests = {"cpu": f"{self.cpu_millis}m", "memory": f"{self.memory_mib}Mi"}
        limits = {"memory": f"{self.memory_mib}Mi"}
        if self.gpus:  # a model without GPUs neither requests nor limits nvidia.com/gpu (policy serving-cpu-model)
            requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(self.gpus)
        return {"requests": requests, "limits": limits}


def pod_share(instance_types: list[str], gpus_per_node: int, gpus: int) -> PodShare:
    """The share of a node that a pod with `gpus` GPUs gets: the per-GPU slice of the smallest allocatable among
    the pool's types, times its GPUs, so that every type the pool may launch holds `gpus_per_node / gpus` such pods.
    CPU rounds down to 100 millicores, memory to 256 MiB."""
    if not instance_types:
        raise ValueError("a pool without instance types cannot be sized")
    slices = [allocatable(t) for t in instance_types]
    cpu = min(a.cpu_millis for a in slices) * gpus // gpus_per_node
    memory = min(a.memory_mib for a in slices) * gpus // gpus_per_node
    return PodShare(cpu_millis=cpu // 100 * 100, memory_mib=memory // 256 * 256, gpus=gpus)


def cpu_pod_share(instance_types: list[str], pods_per_node: int) -> PodShare:
    """A pod of a model without GPUs: 1/pods_per_node of the smallest allocatable among its CPU pool's types, so
    that every type the pool may launch holds `pods_per_node` such pods. Rounded as pod_share rounds."""
    if not instance_types:
        raise ValueError("a pool without instance types cannot be sized")
    slices = [allocatable(t) for t in instance_types]
    cpu = min(a.cpu_millis for a in slices) // pods_per_node
    memory = min(a.memory_mib for a in slices) // pods_per_node
    return PodShare(cpu_millis=cpu // 100 * 100, memory_mib=memory // 256 * 256, gpus=0)


_QUANTITY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9,
                    "T": 10**12, "m": 1e-3}


def parse_quantity(value: object) -> float:
    """A Kubernetes quantity ("8", "7400m", "28Gi", "512Mi") as a number of units (cores, bytes, GPUs)."""
    text = str(value).strip()
    for suffix in sorted(_QUANTITY_SUFFIX, key=len, reverse=True):
        if text.endswith(suffix) and text[: -len(suffix)].replace(".", "", 1).isdigit():
            return float(text[: -len(suffix)]) * _QUANTITY_SUFFIX[suffix]
    return float(text)
