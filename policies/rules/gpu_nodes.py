"""GPU managed node groups: the NVIDIA AMI, the GPU taint, approved instance types per environment, a size cap.

The approved types and the caps are this pack's decision, not the stack's: a stack cannot approve its own spend.
Changing them is a reviewed change to this file.
"""

from __future__ import annotations

import re

from pulumi_policy import (
    EnforcementLevel,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from infra.naming import CPU_NODE_GROUP_LABEL

from .._props import as_bool, as_list, as_number, get, iter_mappings
from ..context import stack_context
from ..index import StackIndex

NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
GPU_TAINT_KEY = "nvidia.com/gpu"
# EKS-optimised accelerated AMIs with the NVIDIA driver and container toolkit. AL2_x86_64_GPU is left out on
# purpose: Amazon Linux 2 AMIs for EKS stopped receiving updates in November 2025.
NVIDIA_AMI_TYPES = (
    "AL2023_x86_64_NVIDIA",
    "AL2023_ARM_64_NVIDIA",
    "BOTTLEROCKET_x86_64_NVIDIA",
    "BOTTLEROCKET_ARM_64_NVIDIA",
)
APPROVED_INSTANCE_TYPES: dict[str, frozenset[str]] = {
    # Small single-GPU and 4-GPU shapes for development and tiny models.
    "dev": frozenset({
        "g5.xlarge", "g5.2xlarge", "g5.4xlarge", "g5.8xlarge", "g5.12xlarge",
        "g6.xlarge", "g6.2xlarge", "g6.4xlarge", "g6.12xlarge",
        "g6e.xlarge", "g6e.2xlarge", "g6e.4xlarge", "g6e.12xlarge",
    }),
    "staging": frozenset({
        "g5.2xlarge", "g5.12xlarge", "g5.48xlarge", "g6e.2xlarge", "g6e.12xlarge", "g6e.48xlarge", "p4d.24xlarge",
    }),
    # Production serving shapes: 24-48 GB GPUs for small and mid models, A100/H100/H200 nodes for large ones.
    "prod": frozenset({
        "g5.2xlarge", "g5.12xlarge", "g5.48xlarge",
        "g6e.2xlarge", "g6e.12xlarge", "g6e.24xlarge", "g6e.48xlarge",
        "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge",
    }),
}
# The node groups of models without GPUs (infra.config cpuNodeGroups): general purpose and compute optimised types.
APPROVED_CPU_INSTANCE_TYPES: dict[str, frozenset[str]] = {
    "dev": frozenset({"m7i.large", "m7i.xlarge", "m7i.2xlarge", "c7i.xlarge", "c7i.2xlarge"}),
    "staging": frozenset({"m7i.xlarge", "m7i.2xlarge", "c7i.xlarge", "c7i.2xlarge", "c7i.4xlarge"}),
    "prod": frozenset({"m7i.xlarge", "m7i.2xlarge", "m7i.4xlarge", "c7i.xlarge", "c7i.2xlarge", "c7i.4xlarge"}),
}
MAX_NODES: dict[str, int] = {"dev": 4, "staging": 8, "prod": 32}
_GPU_FAMILY = re.compile(r"^(g\d|p\d|gr\d)[a-z-]*\.")


def is_gpu_node_group(props) -> bool:
    ami = str(get(props, "amiType") or "")
    return (
        "NVIDIA" in ami
        or "GPU" in ami
        or any(_GPU_FAMILY.match(str(t)) for t in as_list(get(props, "instanceTypes")))
        or any(get(t, "key") == GPU_TAINT_KEY for t in iter_mappings(get(props, "taints")))
    )


def _gpu_group(args: ResourceValidationArgs) -> bool:
    return args.resource_type == NODE_GROUP and is_gpu_node_group(args.props)


def _validate_ami(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _gpu_group(args):
        return
    ami = get(args.props, "amiType")
    if ami not in NVIDIA_AMI_TYPES:
        report(
            f"GPU node group {args.name!r} has amiType {ami!r}: use one of {', '.join(NVIDIA_AMI_TYPES)} "
            f"(EKS-optimised, with the NVIDIA driver and container toolkit)",
            None,
        )


def _validate_taint(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _gpu_group(args):
        return
    taints = list(iter_mappings(get(args.props, "taints")))
    if not any(get(t, "key") == GPU_TAINT_KEY and get(t, "effect") == "NO_SCHEDULE" for t in taints):
        shown = [f"{get(t, 'key')}:{get(t, 'effect')}" for t in taints] or "none"
        report(
            f"GPU node group {args.name!r} lacks the taint {GPU_TAINT_KEY} with effect NO_SCHEDULE (taints: {shown}): "
            f"without it any pod can land on a GPU node and hold it",
            None,
        )


def _validate_instance_types(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _gpu_group(args):
        return
    ctx = stack_context(args)
    approved = APPROVED_INSTANCE_TYPES.get(ctx.env)
    if approved is None:
        report(f"GPU node group {args.name!r}: environment {ctx.env!r} has no approved GPU instance types", None)
        return
    types = [str(t) for t in as_list(get(args.props, "instanceTypes"))]
    if not types:
        report(
            f"GPU node group {args.name!r} does not list instanceTypes, so the approved types for {ctx.env} cannot "
            f"be checked: set them on the node group",
            None,
        )
    bad = [t for t in types if t not in approved]
    if bad:
        report(
            f"GPU node group {args.name!r}: instance type(s) {', '.join(bad)} not approved for {ctx.env} "
            f"(approved: {', '.join(sorted(approved))})",
            None,
        )


def _validate_cpu_group(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """A CPU node group (its nodes labelled CPU_NODE_GROUP_LABEL, where models without GPUs run) has no GPUs: no
    NVIDIA AMI, no GPU instance type, no GPU taint; and it uses the CPU types approved for the environment."""
    if args.resource_type != NODE_GROUP or not (get(args.props, "labels") or {}).get(CPU_NODE_GROUP_LABEL):
        return
    if is_gpu_node_group(args.props):
        report(f"CPU node group {args.name!r} (label {CPU_NODE_GROUP_LABEL}) has GPUs (amiType "
               f"{get(args.props, 'amiType')!r}, instanceTypes {as_list(get(args.props, 'instanceTypes'))}): models "
               f"without gpu would be scheduled on GPU nodes", None)
    ctx = stack_context(args)
    approved = APPROVED_CPU_INSTANCE_TYPES.get(ctx.env)
    if approved is None:
        report(f"CPU node group {args.name!r}: environment {ctx.env!r} has no approved CPU instance types", None)
        return
    types = [str(t) for t in as_list(get(args.props, "instanceTypes"))]
    bad = [t for t in types if t not in approved]
    if bad or not types:
        report(f"CPU node group {args.name!r}: instance type(s) {bad or 'unlisted'} not approved for {ctx.env} "
               f"(approved: {', '.join(sorted(approved))})", None)


def _validate_size(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _gpu_group(args):
        return
    ctx = stack_context(args)
    cap = MAX_NODES.get(ctx.env)
    scaling = get(args.props, "scalingConfig") or {}
    max_size, min_size, desired = (as_number(get(scaling, k)) for k in ("maxSize", "minSize", "desiredSize"))
    if max_size is None:
        report(f"GPU node group {args.name!r} has no scalingConfig.maxSize", None)
        return
    if cap is not None and max_size > cap:
        report(
            f"GPU node group {args.name!r}: maxSize {int(max_size)} exceeds the {ctx.env} cap of {cap} nodes "
            f"(raise the cap in policies/rules/gpu_nodes.py through review, not in the stack)",
            None,
        )
    if min_size is not None and desired is not None and not min_size <= desired <= max_size:
        report(
            f"GPU node group {args.name!r}: scalingConfig needs minSize <= desiredSize <= maxSize, got "
            f"{int(min_size)} / {int(desired)} / {int(max_size)}",
            None,
        )


def _validate_node_metadata(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for group in index.of_type(NODE_GROUP):
        if get(group.props, "launchTemplate") is None:
            report(f"node group {group.name!r} uses EKS's default launch template, which leaves the instance metadata "
                   f"service reachable from pods (hop limit 2): give it a launch template with httpTokens required "
                   f"and httpPutResponseHopLimit 1, so pods get credentials only through IRSA", group.urn)
            continue
        template = index.referenced(group, (LAUNCH_TEMPLATE,), "launchTemplate", ("name",))
        if template is None:
            continue  # a template from outside this stack: nothing here to read
        metadata = get(template.props, "metadataOptions") or {}
        if get(metadata, "httpTokens") != "required":
            report(f"node group {group.name!r}: launch template {template.name!r} allows IMDSv1 (metadataOptions."
                   f"httpTokens is {get(metadata, 'httpTokens')!r}, not 'required')", group.urn)
        hops = as_number(get(metadata, "httpPutResponseHopLimit"))
        if hops != 1:
            report(f"node group {group.name!r}: launch template {template.name!r} lets pods reach the node's "
                   f"credentials (httpPutResponseHopLimit {'unset' if hops is None else f'{hops:g}'}, needs 1)",
                   group.urn)
        for mapping in iter_mappings(get(template.props, "blockDeviceMappings")):
            if as_bool(get(mapping, "ebs", "encrypted")) is not True:
                report(f"node group {group.name!r}: launch template {template.name!r} volume "
                       f"{mapping.get('deviceName')!r} is not encrypted", group.urn)


gpu_nvidia_ami = ResourceValidationPolicy(
    name="gpu-nodes-nvidia-ami",
    description="GPU node groups use an EKS-optimised NVIDIA AMI type.",
    validate=_validate_ami,
    enforcement_level=EnforcementLevel.MANDATORY,
)
gpu_taint = ResourceValidationPolicy(
    name="gpu-nodes-taint",
    description="GPU node groups carry the nvidia.com/gpu NoSchedule taint.",
    validate=_validate_taint,
    enforcement_level=EnforcementLevel.MANDATORY,
)
gpu_instance_types = ResourceValidationPolicy(
    name="gpu-nodes-approved-instance-types",
    description="GPU node groups use only the instance types approved for the stack's environment.",
    validate=_validate_instance_types,
    enforcement_level=EnforcementLevel.MANDATORY,
)
gpu_size_cap = ResourceValidationPolicy(
    name="gpu-nodes-size-cap",
    description="GPU node groups stay under the environment's node cap, with a consistent scaling config.",
    validate=_validate_size,
    enforcement_level=EnforcementLevel.MANDATORY,
)

nodes_metadata = StackValidationPolicy(
    name="nodes-imdsv2-and-encrypted-disks",
    description="Node groups use a launch template with IMDSv2, hop limit 1 and encrypted volumes.",
    validate=_validate_node_metadata,
    enforcement_level=EnforcementLevel.MANDATORY,
)

cpu_node_groups = ResourceValidationPolicy(
    name="cpu-nodes-no-gpu-approved-types",
    description="CPU node groups (for models without GPUs) have no GPUs and use only the CPU instance types approved "
                "for the stack's environment.",
    validate=_validate_cpu_group,
    enforcement_level=EnforcementLevel.MANDATORY,
)

POLICIES = [gpu_nvidia_ami, gpu_taint, gpu_instance_types, gpu_size_cap, cpu_node_groups, nodes_metadata]
