"""The model node groups (the config's GPU and CPU node groups), defined once for both places that render them:
infra/cluster.py makes each one a managed node group with its launch template (the floor, `desiredSize` nodes),
infra/bootstrap.py an EC2NodeClass and a NodePool (Karpenter's nodes above the floor). Both read the same labels,
taint, instance types, AMI, volumes, subnets and names from a `ModelNodeGroup`, so the pool's nodes stay the group's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from infra.config import ClusterConfig, CpuNodeGroupConfig, GpuNodeGroupConfig
from infra.instances import INSTANCE_FACTS
from infra.naming import CPU_NODE_GROUP_LABEL, GPU_NODE_GROUP_LABEL, POOL_LABEL

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}


def gpu_node_labels(group: GpuNodeGroupConfig) -> dict[str, str]:
    return {
        **group.labels,
        POOL_LABEL: "gpu",
        GPU_NODE_GROUP_LABEL: group.name,
        "nvidia.com/gpu.present": "true",
        # The device plugin DaemonSet selects on this: only AMIs without NVIDIA's plugin get ours.
        "llm-serving/device-plugin": "program" if group.needs_device_plugin else "ami",
    }


def cpu_node_labels(group: CpuNodeGroupConfig) -> dict[str, str]:
    """A CPU node group's nodes: the models without GPUs select them by CPU_NODE_GROUP_LABEL (no taint: nothing
    on them is scarce enough to keep other pods off)."""
    return {**group.labels, POOL_LABEL: "cpu", CPU_NODE_GROUP_LABEL: group.name}


def node_pool_gpu_limit(group: GpuNodeGroupConfig) -> int:
    """The GPUs a NodePool may add on top of its node group's nodes (desiredSize, which nothing else moves): the
    group's maxSize stays the total cap."""
    return (group.scaling.max_size - group.scaling.desired_size) * group.gpus_per_node


def node_pool_cpu_limit(group: CpuNodeGroupConfig) -> int:
    """The vCPUs a CPU group's NodePool may add on top of its node group's nodes: (maxSize - desiredSize) nodes of
    its largest type, so the pool stays within the group's maxSize nodes."""
    return (group.scaling.max_size - group.scaling.desired_size) * max(
        INSTANCE_FACTS[t].vcpus for t in group.instance_types)


@dataclass(frozen=True)
class ModelNodeGroup:
    """One GPU or CPU node group of the config, as its managed node group and its Karpenter pool both need it.

    A CPU group is a GPU group without the GPU taint, the NVIDIA AMI and EFA (cpuNodeGroups in infra.config)."""

    kind: Literal["gpu", "cpu"]
    config: GpuNodeGroupConfig | CpuNodeGroupConfig

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def full_name(self) -> str:
        """`gpu-<name>` / `cpu-<name>`: the EC2NodeClass's and NodePool's name, the managed node group's name
        prefix (with a trailing dash), the suffix of its resource names and of its instances' Name tag."""
        return f"{self.kind}-{self.config.name}"

    @property
    def karpenter_key(self) -> str:
        """The suffix of the EC2NodeClass's and NodePool's Pulumi resource names: a GPU group's is its bare name
        (the GPU pools came first), a CPU group's `cpu-<name>`. Part of their URNs: do not change."""
        return self.config.name if self.kind == "gpu" else self.full_name

    @property
    def efa(self) -> bool:
        return self.kind == "gpu" and self.config.efa

    @property
    def labels(self) -> dict[str, str]:
        return gpu_node_labels(self.config) if self.kind == "gpu" else cpu_node_labels(self.config)

    @property
    def group_label(self) -> str:
        """The node label that names the group (what a model's pods select)."""
        return GPU_NODE_GROUP_LABEL if self.kind == "gpu" else CPU_NODE_GROUP_LABEL

    @property
    def taints(self) -> list[dict[str, str]]:
        """In the managed node group's shape (effect NO_SCHEDULE); GPU nodes only run what tolerates it."""
        return [GPU_TAINT] if self.kind == "gpu" else []

    def subnets(self, private_subnet_ids: list) -> list:
        """EFA wants the nodes close together: one AZ (the first private subnet); otherwise every private subnet."""
        return private_subnet_ids[:1] if self.efa else private_subnet_ids

    def pool_limits(self) -> dict[str, str]:
        """The NodePool's limits: what it may add above the node group's desiredSize, within its maxSize."""
        if self.kind == "gpu":
            return {"nvidia.com/gpu": str(node_pool_gpu_limit(self.config))}
        return {"cpu": str(node_pool_cpu_limit(self.config))}


def model_node_groups(cluster: ClusterConfig) -> list[ModelNodeGroup]:
    """Every GPU node group, then every CPU node group, in the config's order."""
    return ([ModelNodeGroup("gpu", g) for g in cluster.gpu_node_groups]
            + [ModelNodeGroup("cpu", g) for g in cluster.cpu_node_groups])
