"""EKS cluster, its system, GPU and CPU managed node groups, IRSA's OIDC provider and the Kubernetes provider.

Built from `aws.eks.*` resources inside this component rather than `pulumi_eks`: its components are implemented in
another language and register as one opaque resource under the mock runtime, hiding the node groups from tests and
policies (docs/local-environment.md, "Pulumi offline").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.config import ClusterConfig
from infra.iam import role_with_policy, service_trust
from infra.naming import POOL_LABEL
from infra.node_groups import ModelNodeGroup, model_node_groups

SYSTEM_AMI = "AL2023_x86_64_STANDARD"
SYSTEM_DISK_GIB = 100
CLUSTER_POLICIES = ["arn:aws:iam::aws:policy/AmazonEKSClusterPolicy"]
NODE_POLICIES = [
    "arn:aws:iam::aws:policy/AmazonEKSWorkerNodePolicy",
    "arn:aws:iam::aws:policy/AmazonEC2ContainerRegistryReadOnly",
    "arn:aws:iam::aws:policy/AmazonEKS_CNI_Policy",
]
# Managed add-ons on every cluster. vpc-cni enforces NetworkPolicy only with its network policy agent turned on
# (without it the program's NetworkPolicies are accepted and ignored); eks-pod-identity-agent serves EKS Pod
# Identity, which the node autoscaler's controller uses (infra/bootstrap.py).
ADDONS = ("vpc-cni", "coredns", "kube-proxy", "eks-pod-identity-agent")
ADDON_CONFIGURATION = {"vpc-cni": {"enableNetworkPolicy": "true"}}
# Bottlerocket keeps the OS on /dev/xvda and containers' images and writable layers on the data volume /dev/xvdb,
# whose 20 GiB default cannot hold the Triton+vLLM image (tens of GB unpacked, twice during an image rollout).
BOTTLEROCKET_OS_GIB = 8


@dataclass(frozen=True)
class ClusterArgs:
    cluster_name: str
    config: ClusterConfig
    vpc_id: pulumi.Input[str]
    private_subnet_ids: list[pulumi.Input[str]]
    tags: dict[str, str] = field(default_factory=dict)


def _kubeconfig(name: pulumi.Output[str], endpoint: pulumi.Output[str], ca: pulumi.Output[str],
                region: str) -> pulumi.Output[str]:
    def build(args: list[str]) -> str:
        cluster, server, cert = args
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": cluster,
            "clusters": [{"name": cluster, "cluster": {"server": server, "certificate-authority-data": cert}}],
            "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": cluster}}],
            "users": [{"name": cluster, "user": {"exec": {
                "apiVersion": "client.authentication.k8s.io/v1beta1", "command": "aws",
                "args": ["eks", "get-token", "--cluster-name", cluster, "--region", region],
            }}}],
        })
    return pulumi.Output.all(name, endpoint, ca).apply(build)


def _volume(device: str, size_gib: int) -> dict:
    return {"device_name": device, "ebs": {"volume_size": size_gib, "volume_type": "gp3", "encrypted": "true",
                                           "delete_on_termination": "true"}}


def block_devices(ami_type: str, disk_size_gib: int) -> list[dict]:
    """Where the node's images live gets `disk_size_gib`: the root volume on AL2023, the data volume on
    Bottlerocket (its root volume only holds the OS)."""
    if ami_type.startswith("BOTTLEROCKET"):
        return [_volume("/dev/xvda", BOTTLEROCKET_OS_GIB), _volume("/dev/xvdb", disk_size_gib)]
    return [_volume("/dev/xvda", disk_size_gib)]


def launch_template_args(name: str, disk_size_gib: int, tags: dict[str, str], ami_type: str = SYSTEM_AMI) -> dict:
    """Every node group's launch template: encrypted gp3 volumes sized for the images, and IMDSv2 only with one
    hop, so pods cannot borrow the node's role (they get theirs through IRSA)."""
    return {
        "block_device_mappings": block_devices(ami_type, disk_size_gib),
        "metadata_options": {"http_endpoint": "enabled", "http_tokens": "required", "http_put_response_hop_limit": 1},
        "tag_specifications": [{"resource_type": "instance", "tags": {**tags, "Name": name}}],
    }


class Cluster(pulumi.ComponentResource):
    name: pulumi.Output[str]
    node_security_group_id: pulumi.Output[str]
    oidc_provider_arn: pulumi.Output[str]
    oidc_issuer_url: pulumi.Output[str]
    provider: k8s.Provider
    kubeconfig: pulumi.Output[str]
    node_groups: dict[str, aws.eks.NodeGroup]

    def __init__(self, name: str, args: ClusterArgs, region: str, opts: pulumi.ResourceOptions | None = None):
        super().__init__("llm-serving:infra:Cluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        cfg = args.config
        bootstrap_cidrs = list(cfg.api_access.bootstrap_public_cidrs)

        cluster_role = role_with_policy(f"{name}-cluster", service_trust("eks.amazonaws.com"), None,
                                        CLUSTER_POLICIES, args.tags, child)
        secrets_key = aws.kms.Key(f"{name}-secrets", description=f"EKS secrets envelope key for {args.cluster_name}",
                                  enable_key_rotation=True, deletion_window_in_days=30, tags=args.tags, opts=child)
        cluster = aws.eks.Cluster(
            name,
            name=args.cluster_name,
            version=cfg.kubernetes_version,
            role_arn=cluster_role.arn,
            vpc_config={
                "subnet_ids": args.private_subnet_ids,
                "endpoint_private_access": True,
                # Public only when the stack allows it (dev) or, restricted to the runner, for a first update that
                # cannot reach the private endpoint yet (docs/first-update.md).
                "endpoint_public_access": cfg.endpoint_public_access or bool(bootstrap_cidrs),
                **({"public_access_cidrs": bootstrap_cidrs} if bootstrap_cidrs else {}),
            },
            access_config={"authentication_mode": "API", "bootstrap_cluster_creator_admin_permissions": True},
            encryption_config={"provider": {"key_arn": secrets_key.arn}, "resources": ["secrets"]},
            enabled_cluster_log_types=["api", "audit", "authenticator", "controllerManager", "scheduler"],
            tags=args.tags,
            opts=child,
        )
        self.name = cluster.name
        self.endpoint = cluster.endpoint
        # The private endpoint answers on the cluster security group: a runner inside the VPC (or routed to it)
        # needs TCP 443 there, which EKS does not open by default (only the group itself).
        for i, cidr in enumerate(cfg.api_access.runner_cidrs):
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-api-runner-{i}", security_group_id=cluster.vpc_config.cluster_security_group_id,
                ip_protocol="tcp", from_port=443, to_port=443, cidr_ipv4=cidr,
                description=f"Kubernetes API from the update's runner ({cidr})", opts=child)
        self.node_security_group_id = cluster.vpc_config.cluster_security_group_id
        self.oidc_issuer_url = cluster.identities.apply(lambda ids: ids[0]["oidcs"][0]["issuer"])
        oidc = aws.iam.OpenIdConnectProvider(f"{name}-oidc", url=self.oidc_issuer_url,
                                             client_id_lists=["sts.amazonaws.com"], tags=args.tags, opts=child)
        self.oidc_provider_arn = oidc.arn

        node_role = role_with_policy(f"{name}-node", service_trust("ec2.amazonaws.com"), None, NODE_POLICIES,
                                     args.tags, child)
        # Karpenter's nodes use the same role: the managed node groups' access entry already admits it.
        self.node_role_name = node_role.name
        system_template = aws.ec2.LaunchTemplate(
            f"{name}-system", update_default_version=True, tags=args.tags, opts=child,
            **launch_template_args(f"{name}-system", SYSTEM_DISK_GIB, args.tags))
        system = aws.eks.NodeGroup(
            f"{name}-system",
            cluster_name=cluster.name,
            node_role_arn=node_role.arn,
            subnet_ids=args.private_subnet_ids,
            ami_type=SYSTEM_AMI,
            instance_types=cfg.system_node_group.instance_types,
            scaling_config={"min_size": cfg.system_node_group.scaling.min_size,
                            "max_size": cfg.system_node_group.scaling.max_size,
                            "desired_size": cfg.system_node_group.scaling.desired_size},
            labels={POOL_LABEL: "system"},
            launch_template={"id": system_template.id, "version": system_template.latest_version.apply(str)},
            update_config={"max_unavailable": 1},
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["scalingConfig.desiredSize"]),
        )
        self.node_groups = {"system": system}
        for group in model_node_groups(cfg):
            self.node_groups[group.name] = self._model_node_group(name, group, cluster, node_role, args)
        self.addons = {}
        for addon in ADDONS:
            settings = ADDON_CONFIGURATION.get(addon)
            self.addons[addon] = aws.eks.Addon(
                f"{name}-{addon}", cluster_name=cluster.name, addon_name=addon,
                configuration_values=json.dumps(settings) if settings else None,
                resolve_conflicts_on_update="OVERWRITE", tags=args.tags,
                opts=pulumi.ResourceOptions(parent=self, depends_on=[system]))
        # Static provisioning only (one PersistentVolume per file system): the driver mounts, it calls no AWS API,
        # so it gets no IAM role at all.
        self.fsx_csi_addon = aws.eks.Addon(f"{name}-aws-fsx-csi-driver", cluster_name=cluster.name,
                                           addon_name="aws-fsx-csi-driver", resolve_conflicts_on_update="OVERWRITE",
                                           tags=args.tags, opts=pulumi.ResourceOptions(parent=self,
                                                                                       depends_on=[system]))

        self.kubeconfig = pulumi.Output.secret(_kubeconfig(cluster.name, cluster.endpoint,
                                                           cluster.certificate_authority.data, region))
        self.provider = k8s.Provider(f"{name}-k8s", kubeconfig=self.kubeconfig, enable_server_side_apply=True,
                                     opts=pulumi.ResourceOptions(parent=self, depends_on=[system]))
        self.register_outputs({"name": self.name, "oidcProviderArn": self.oidc_provider_arn})

    def _model_node_group(self, name: str, group: ModelNodeGroup, cluster: aws.eks.Cluster,
                          node_role: aws.iam.Role, args: ClusterArgs) -> aws.eks.NodeGroup:
        """A GPU or CPU group's managed node group (infra/node_groups.py): the same role and launch template rules
        as the system nodes, on-demand capacity, Karpenter above its desiredSize (infra/bootstrap.py)."""
        child = pulumi.ResourceOptions(parent=self)
        full = f"{name}-{group.full_name}"
        lt_args = launch_template_args(full, group.config.disk_size_gib, args.tags, group.config.ami_type)
        if group.efa:
            # EFA wants the nodes close together: one AZ and a cluster placement group, one EFA interface per node.
            placement = aws.ec2.PlacementGroup(f"{full}-pg", strategy="cluster", tags=args.tags, opts=child)
            lt_args["placement"] = {"group_name": placement.name}
            lt_args["network_interfaces"] = [{"device_index": 0, "network_card_index": 0, "interface_type": "efa",
                                              "delete_on_termination": "true",
                                              "security_groups": [cluster.vpc_config.cluster_security_group_id]}]
        template = aws.ec2.LaunchTemplate(full, update_default_version=True, tags=args.tags, opts=child, **lt_args)
        return aws.eks.NodeGroup(
            full,
            cluster_name=cluster.name,
            node_group_name_prefix=f"{group.full_name}-",
            node_role_arn=node_role.arn,
            subnet_ids=group.subnets(args.private_subnet_ids),
            ami_type=group.config.ami_type,
            instance_types=group.config.instance_types,
            capacity_type="ON_DEMAND",
            scaling_config={"min_size": group.config.scaling.min_size, "max_size": group.config.scaling.max_size,
                            "desired_size": group.config.scaling.desired_size},
            launch_template={"id": template.id, "version": template.latest_version.apply(str)},
            labels=group.labels,
            taints=group.taints or None,
            update_config={"max_unavailable": 1},
            tags={**args.tags, "k8s.io/cluster-autoscaler/node-template/label/" + group.group_label: group.name},
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["scalingConfig.desiredSize"]),
        )
