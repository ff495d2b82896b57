"""Nodes and cluster add-ons that a fresh cluster needs before models can run on it.

- Bottlerocket nodes keep images on their data volume (`/dev/xvdb`), 20 GiB unless the launch template sizes it:
  the serving image does not fit, and pulls fail with "no space left on device".
- vpc-cni ignores NetworkPolicy objects unless its network policy agent is on (`enableNetworkPolicy`): a stack that
  creates NetworkPolicies without it believes in isolation it does not have.
- EKS Pod Identity (the node autoscaler's credentials) needs the `eks-pod-identity-agent` add-on on the cluster.
"""

from __future__ import annotations

from pulumi_policy import EnforcementLevel, ReportViolation, StackValidationArgs, StackValidationPolicy

from infra.instances import MIN_IMAGE_VOLUME_GIB

from .._props import as_number, get, iter_mappings, json_document
from ..index import StackIndex

NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
CLUSTER = "aws:eks/cluster:Cluster"
ADDON = "aws:eks/addon:Addon"
BOTTLEROCKET_DATA_DEVICE = "/dev/xvdb"
REQUIRED_ADDONS = ("vpc-cni", "eks-pod-identity-agent")


def _validate_bottlerocket_volume(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for group in index.of_type(NODE_GROUP):
        if not str(get(group.props, "amiType") or "").startswith("BOTTLEROCKET"):
            continue
        template = index.referenced(group, (LAUNCH_TEMPLATE,), "launchTemplate", ("name",))
        mappings = list(iter_mappings(get(template.props, "blockDeviceMappings"))) if template else []
        data = [m for m in mappings if m.get("deviceName") == BOTTLEROCKET_DATA_DEVICE]
        size = as_number(get(data[0], "ebs", "volumeSize")) if data else None
        if size is None or size < MIN_IMAGE_VOLUME_GIB:
            shown = "keeps Bottlerocket's 20 GiB default" if size is None else f"is {size:g} GiB"
            report(f"Bottlerocket node group {group.name!r}: the data volume {BOTTLEROCKET_DATA_DEVICE}, where images "
                   f"live, {shown}; the serving image needs at least {MIN_IMAGE_VOLUME_GIB} GiB (map "
                   f"{BOTTLEROCKET_DATA_DEVICE} in the launch template, infra/cluster.py block_devices)", group.urn)


def _addons(index: StackIndex, cluster) -> dict[str, object]:
    return {str(get(a.props, "addonName")): a for a in index.of_type(ADDON)
            if index.depends_on(a, cluster) or get(a.props, "clusterName") == get(cluster.props, "name")}


def _validate_addons(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    network_policies = index.k8s("NetworkPolicy")
    for cluster in index.of_type(CLUSTER):
        addons = _addons(index, cluster)
        missing = [a for a in REQUIRED_ADDONS if a not in addons]
        if missing:
            report(f"EKS cluster {cluster.name!r} lacks the managed add-on(s) {', '.join(missing)} (vpc-cni with "
                   f"network policy enforcement; eks-pod-identity-agent for EKS Pod Identity)", cluster.urn)
        cni = addons.get("vpc-cni")
        if cni is None or not network_policies:
            continue
        settings = json_document(get(cni.props, "configurationValues") or "{}") or {}
        if str(settings.get("enableNetworkPolicy", "false")).lower() != "true":
            report(f"EKS cluster {cluster.name!r}: the stack creates {len(network_policies)} NetworkPolicy "
                   f"object(s), but vpc-cni's network policy agent is off (configurationValues.enableNetworkPolicy "
                   f"is not \"true\"): every NetworkPolicy is accepted and ignored", cluster.urn)


nodes_bottlerocket_data_volume = StackValidationPolicy(
    name="nodes-bottlerocket-data-volume",
    description=f"Bottlerocket node groups size their data volume ({BOTTLEROCKET_DATA_DEVICE}) for the serving image.",
    validate=_validate_bottlerocket_volume,
    enforcement_level=EnforcementLevel.MANDATORY,
)
eks_required_addons = StackValidationPolicy(
    name="eks-network-policy-and-pod-identity",
    description="EKS clusters run vpc-cni with network policy enforcement (when the stack has NetworkPolicies) and "
                "the eks-pod-identity-agent add-on.",
    validate=_validate_addons,
    enforcement_level=EnforcementLevel.MANDATORY,
)

POLICIES = [nodes_bottlerocket_data_volume, eks_required_addons]
