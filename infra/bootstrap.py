"""What a fresh cluster needs before the program's own objects can exist on it (docs/first-update.md).

Installed by the program itself, in the same update, each Helm chart pinned by version, with `depends_on` so that
every CustomResourceDefinition exists before a custom resource of its kind ("no matches for kind" otherwise):

    Gateway API CRDs + Envoy Gateway's CRDs (gateway-crds-helm)  -> Envoy Gateway (gateway-helm) -> GatewayClass
    Prometheus Operator (kube-prometheus-stack, in the monitoring namespace) -> PodMonitor, PrometheusRule
    Karpenter's CRDs (karpenter-crd) -> Karpenter (controller, EKS Pod Identity) -> EC2NodeClass + NodePool per
        GPU node group and per CPU node group
    cert-manager (+ its CRDs) -> ClusterIssuer (ACME DNS-01 on the stack's Route53 zone) -> Certificate for the
        model hostnames, the Gateway's TLS secret
    (infra/serving_platform.py: the Certificate in the serving namespace, the Gateway waits for it)
    ExternalDNS: the routes' hostnames as Route53 records of the Gateway's load balancer

KEDA and NVIDIA's device plugin stay in `infra/serving_platform.py`.

**The gateway: Envoy Gateway.** It implements the standard channel's HTTPRoute and GRPCRoute with weighted
backendRefs (the red-black split, §4) inside the cluster, sets the route conditions (`Accepted`, `ResolvedRefs`)
that the routes' await waits on (infra/serving.py), and needs nothing outside the cluster but a load balancer for
its Service. The AWS Gateway API controller (VPC Lattice) was the other candidate: it also implements weights, but
needs a Lattice service network associated with the VPC, the ACM certificate ARN in each listener's `tls.options`,
node security group ingress from Lattice's managed prefix list and its own DNS, four more AWS moving parts per
region, and its routes are programmed asynchronously outside the cluster.

**Node autoscaling: Karpenter.** Each GPU node group keeps its `desiredSize` nodes as a managed node group (the
floor, there before Karpenter runs); a NodePool with the same labels, taint and instance types adds up to
`maxSize - desiredSize` nodes' GPUs when red-black surge pods or KEDA replicas are pending, and removes empty
nodes. The pool never goes beyond the group's `maxSize` in total, the cap `gpu-nodes-size-cap` reviews. Only
on-demand capacity for now (spot needs Karpenter's interruption queue, capacity reservations its selector terms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.charts import CHARTS
from infra.cluster import block_devices
from infra.config import StackConfig
from infra.iam import policy_document, role_with_policy
from infra.naming import platform_labels
from infra.node_groups import ModelNodeGroup, model_node_groups

GATEWAY_NAMESPACE = "envoy-gateway-system"
GATEWAY_CLASS = "envoy-gateway"
GATEWAY_CONTROLLER = "gateway.envoyproxy.io/gatewayclass-controller"
KARPENTER_NAMESPACE = "kube-system"
KARPENTER_SERVICE_ACCOUNT = "karpenter"
CERT_MANAGER_NAMESPACE = "cert-manager"
EXTERNAL_DNS_NAMESPACE = "external-dns"
CLUSTER_ISSUER = "llm-serving-acme"
ACME_SERVER = "https://acme-v02.api.letsencrypt.org/directory"
POD_IDENTITY_SERVICE = "pods.eks.amazonaws.com"


@dataclass(frozen=True)
class BootstrapArgs:
    config: StackConfig
    provider: k8s.Provider
    cluster_name: pulumi.Input[str]
    cluster_endpoint: pulumi.Input[str]
    node_role_name: pulumi.Input[str]
    node_security_group_id: pulumi.Input[str]
    private_subnet_ids: list[pulumi.Input[str]]
    vpc_id: pulumi.Input[str]
    node_groups: list[pulumi.Resource]  # the managed node groups: the controllers run on the system nodes
    pod_identity_addon: pulumi.Resource
    tags: dict[str, str] = field(default_factory=dict)


def pod_identity_trust() -> pulumi.Output[str]:
    return policy_document({"Effect": "Allow", "Principal": {"Service": POD_IDENTITY_SERVICE},
                            "Action": ["sts:AssumeRole", "sts:TagSession"]})


def release_args(key: str) -> dict:
    spec = CHARTS[key]
    args = {"chart": spec["chart"], "version": spec["version"]}
    if "repo" in spec:
        args["repository_opts"] = {"repo": spec["repo"]}
    return args


def karpenter_block_devices(ami_type: str, disk_size_gib: int) -> list[dict]:
    """The node groups' volumes (infra/cluster.py block_devices) in EC2NodeClass's shape."""
    return [{"deviceName": d["device_name"], "ebs": {"volumeSize": f"{d['ebs']['volume_size']}Gi",
                                                     "volumeType": d["ebs"]["volume_type"], "encrypted": True,
                                                     "deleteOnTermination": True}}
            for d in block_devices(ami_type, disk_size_gib)]


def ami_alias(ami_type: str) -> str:
    """Karpenter's AMI alias for a node group's AMI type (it picks the NVIDIA variant for GPU instance types)."""
    return "bottlerocket@latest" if ami_type.startswith("BOTTLEROCKET") else "al2023@latest"


class ClusterBootstrap(pulumi.ComponentResource):
    gateway_class: pulumi.Resource
    monitoring: pulumi.Resource  # kube-prometheus-stack: PodMonitor and PrometheusRule wait for it
    cluster_issuer: pulumi.Resource  # the serving namespace's Certificate (infra/serving_platform.py) waits for it
    ready: list[pulumi.Resource]  # what the serving objects wait for

    def __init__(self, name: str, args: BootstrapArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("llm-serving:infra:ClusterBootstrap", name, None, opts)
        self._args, self._name = args, name
        on_nodes = [*args.node_groups]
        gateway_crds, self.gateway_class = self._gateway(on_nodes)
        self.monitoring = self._monitoring(on_nodes)
        karpenter = self._karpenter(on_nodes)
        self.cluster_issuer, dns = self._certificates_and_dns(on_nodes, gateway_crds)
        self.gateway_crds = gateway_crds
        self.ready = [self.gateway_class, self.monitoring, *karpenter, self.cluster_issuer, dns]
        self.register_outputs({})

    # -- helpers --------------------------------------------------------------------------------------------------

    def _k8s(self, depends_on: list[pulumi.Resource] | None = None) -> pulumi.ResourceOptions:
        return pulumi.ResourceOptions(parent=self, provider=self._args.provider, depends_on=depends_on or [])

    def _namespace(self, key: str, namespace: str, depends_on: list[pulumi.Resource]) -> k8s.core.v1.Namespace:
        return k8s.core.v1.Namespace(f"{self._name}-{key}-ns",
                                     metadata={"name": namespace, "labels": platform_labels(key)},
                                     opts=self._k8s(depends_on))

    def _release(self, key: str, namespace: str, values: dict, depends_on: list[pulumi.Resource],
                 skip_crds: bool = False) -> k8s.helm.v3.Release:
        return k8s.helm.v3.Release(
            f"{self._name}-{key}", name=key, namespace=namespace, values=values, skip_crds=skip_crds,
            # Pulumi waits until the release's workloads are ready, so what depends on it finds a running controller.
            atomic=True, timeout=900, **release_args(key), opts=self._k8s(depends_on))

    def _pod_identity_role(self, key: str, namespace: str, service_account: str,
                           policy: pulumi.Input[str]) -> aws.iam.Role:
        args = self._args
        role = role_with_policy(f"{self._name}-{key}", pod_identity_trust(), policy, (), args.tags,
                                pulumi.ResourceOptions(parent=self))
        aws.eks.PodIdentityAssociation(
            f"{self._name}-{key}", cluster_name=args.cluster_name, namespace=namespace,
            service_account=service_account, role_arn=role.arn, tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[args.pod_identity_addon]))
        return role

    # -- gateway ---------------------------------------------------------------------------------------------------

    def _gateway(self, on_nodes: list[pulumi.Resource]) -> tuple[pulumi.Resource, pulumi.Resource]:
        ns = self._namespace("gateway", GATEWAY_NAMESPACE, on_nodes)
        # CRDs from their own chart: Helm never upgrades a chart's crds/ directory, a CRD chart's templates it does.
        crds = self._release("gateway-crds", GATEWAY_NAMESPACE, {"crds": {
            "gatewayAPI": {"enabled": True, "channel": "standard"}, "envoyGateway": {"enabled": True}}}, [ns])
        controller = self._release("envoy-gateway", GATEWAY_NAMESPACE, {
            "deployment": {"replicas": 2},
        }, [crds], skip_crds=True)
        gateway_class = k8s.apiextensions.CustomResource(
            f"{self._name}-gateway-class", api_version="gateway.networking.k8s.io/v1", kind="GatewayClass",
            metadata={"name": GATEWAY_CLASS, "labels": platform_labels("gateway")},
            spec={"controllerName": GATEWAY_CONTROLLER},
            opts=self._k8s([crds, controller]))
        return crds, gateway_class

    # -- monitoring ------------------------------------------------------------------------------------------------

    def _monitoring(self, on_nodes: list[pulumi.Resource]) -> pulumi.Resource:
        serving = self._args.config.serving
        ns = self._namespace("monitoring", serving.monitoring_namespace, on_nodes)
        release = serving.monitoring_release_label or "kube-prometheus-stack"
        values = {
            "crds": {"enabled": True},
            # The program's PodMonitor and PrometheusRule carry `release: <label>` (infra/observability.py); with
            # the label off they must be selected without it.
            "prometheus": {"prometheusSpec": {
                "podMonitorSelectorNilUsesHelmValues": serving.monitoring_release_label is not None,
                "ruleSelectorNilUsesHelmValues": serving.monitoring_release_label is not None,
                "retention": "15d"}},
            "grafana": {"sidecar": {"dashboards": {"enabled": True, "label": "grafana_dashboard"}}},
        }
        return k8s.helm.v3.Release(
            f"{self._name}-kube-prometheus-stack", name=release, namespace=serving.monitoring_namespace,
            values=values, atomic=True, timeout=900, **release_args("kube-prometheus-stack"),
            opts=self._k8s([ns]))

    # -- node autoscaling ------------------------------------------------------------------------------------------

    def _karpenter(self, on_nodes: list[pulumi.Resource]) -> list[pulumi.Resource]:
        args, cfg = self._args, self._args.config
        account = aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(parent=self)).account_id
        region = cfg.region
        policy = policy_document(
            {"Sid": "LaunchAndTerminateNodes", "Effect": "Allow",
             "Action": ["ec2:CreateFleet", "ec2:RunInstances", "ec2:CreateLaunchTemplate", "ec2:CreateTags",
                        "ec2:TerminateInstances", "ec2:DeleteLaunchTemplate"],
             "Resource": [f"arn:aws:ec2:{region}:*:*"],
             "Condition": {"StringEquals": {"aws:RequestedRegion": region}}},
            {"Sid": "DescribeCapacity", "Effect": "Allow",
             "Action": ["ec2:DescribeAvailabilityZones", "ec2:DescribeImages", "ec2:DescribeInstances",
                        "ec2:DescribeInstanceTypeOfferings", "ec2:DescribeInstanceTypes",
                        "ec2:DescribeLaunchTemplates", "ec2:DescribeSecurityGroups", "ec2:DescribeSubnets",
                        "ec2:DescribeSpotPriceHistory", "ec2:DescribeCapacityReservations", "pricing:GetProducts"],
             "Resource": ["*"]},
            {"Sid": "NodeAmis", "Effect": "Allow", "Action": ["ssm:GetParameter"],
             "Resource": [f"arn:aws:ssm:{region}::parameter/aws/service/*"]},
            {"Sid": "PassNodeRole", "Effect": "Allow", "Action": ["iam:PassRole"],
             "Resource": [pulumi.Output.all(account, args.node_role_name).apply(
                 lambda a: f"arn:aws:iam::{a[0]}:role/{a[1]}")],
             "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}},
            {"Sid": "NodeInstanceProfiles", "Effect": "Allow",
             "Action": ["iam:CreateInstanceProfile", "iam:TagInstanceProfile", "iam:AddRoleToInstanceProfile",
                        "iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile", "iam:GetInstanceProfile",
                        "iam:ListInstanceProfiles"],
             "Resource": [account.apply(lambda a: f"arn:aws:iam::{a}:instance-profile/*")]},
            {"Sid": "DescribeCluster", "Effect": "Allow", "Action": ["eks:DescribeCluster"],
             "Resource": [pulumi.Output.all(account, args.cluster_name).apply(
                 lambda a: f"arn:aws:eks:{region}:{a[0]}:cluster/{a[1]}")]},
        )
        self._pod_identity_role("karpenter", KARPENTER_NAMESPACE, KARPENTER_SERVICE_ACCOUNT, policy)
        crds = self._release("karpenter-crd", KARPENTER_NAMESPACE, {}, on_nodes)
        controller = self._release("karpenter", KARPENTER_NAMESPACE, {
            "settings": {"clusterName": args.cluster_name, "clusterEndpoint": args.cluster_endpoint},
            "serviceAccount": {"name": KARPENTER_SERVICE_ACCOUNT},
            # On the system nodes it does not manage, two replicas.
            "replicas": 2,
            "nodeSelector": {"llm-serving/pool": "system"},
        }, [crds, *on_nodes], skip_crds=True)
        pools = [self._node_pool(group, [crds, controller]) for group in model_node_groups(cfg.cluster)]
        return [controller, *pools]

    def _node_pool(self, group: ModelNodeGroup, after: list[pulumi.Resource]) -> pulumi.Resource:
        """A GPU or CPU node group's EC2NodeClass and NodePool (infra/node_groups.py): its labels, taint, instance
        types, AMI, volumes and subnets, on-demand, up to its maxSize."""
        args, cfg = self._args, self._args.config
        node_class = k8s.apiextensions.CustomResource(
            f"{self._name}-nodeclass-{group.karpenter_key}", api_version="karpenter.k8s.aws/v1", kind="EC2NodeClass",
            metadata={"name": group.full_name, "labels": platform_labels("node-autoscaling")},
            spec={
                "role": args.node_role_name,
                "amiSelectorTerms": [{"alias": ami_alias(group.config.ami_type)}],
                "subnetSelectorTerms": [{"id": s} for s in group.subnets(args.private_subnet_ids)],
                "securityGroupSelectorTerms": [{"id": args.node_security_group_id}],
                "metadataOptions": {"httpEndpoint": "enabled", "httpTokens": "required",
                                    "httpPutResponseHopLimit": 1},
                "blockDeviceMappings": karpenter_block_devices(group.config.ami_type, group.config.disk_size_gib),
                "tags": {**args.tags, "Name": f"{cfg.environment}-{group.full_name}"},
            },
            opts=self._k8s(after))
        taints = [{**t, "effect": "NoSchedule"} for t in group.taints]  # the node group's NO_SCHEDULE, Kubernetes' way
        return k8s.apiextensions.CustomResource(
            f"{self._name}-nodepool-{group.karpenter_key}", api_version="karpenter.sh/v1", kind="NodePool",
            metadata={"name": group.full_name, "labels": platform_labels("node-autoscaling")},
            spec={
                "template": {
                    "metadata": {"labels": group.labels},
                    "spec": {
                        "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass",
                                         "name": group.full_name},
                        **({"taints": taints} if taints else {}),
                        "requirements": [
                            {"key": "node.kubernetes.io/instance-type", "operator": "In",
                             "values": list(group.config.instance_types)},
                            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
                        ],
                        "expireAfter": "720h",
                    },
                },
                "limits": group.pool_limits(),
                # Only empty nodes go: consolidating busy ones would evict model servers mid-request.
                "disruption": {"consolidationPolicy": "WhenEmpty", "consolidateAfter": "10m"},
            },
            opts=self._k8s([*after, node_class]))

    # -- certificates and DNS --------------------------------------------------------------------------------------

    def _certificates_and_dns(self, on_nodes: list[pulumi.Resource],
                              gateway_crds: pulumi.Resource) -> tuple[pulumi.Resource, pulumi.Resource]:
        args, cfg = self._args, self._args.config
        domain = cfg.serving.domain
        # The model hostnames' zone. Public, because ACME's DNS-01 challenge must resolve from outside; its records
        # point at the internal load balancer, so they resolve to private addresses only (docs/first-update.md:
        # delegate it once from the parent zone).
        zone = aws.route53.Zone(f"{self._name}-zone", name=domain, comment=f"model hostnames ({cfg.region})",
                                force_destroy=False, tags=args.tags, opts=pulumi.ResourceOptions(parent=self))
        change_records = policy_document(
            {"Sid": "ChangeModelRecords", "Effect": "Allow",
             "Action": ["route53:ChangeResourceRecordSets", "route53:ListResourceRecordSets"],
             "Resource": [zone.arn]},
            {"Sid": "FollowChanges", "Effect": "Allow", "Action": ["route53:GetChange"],
             "Resource": ["arn:aws:route53:::change/*"]},
            {"Sid": "FindZone", "Effect": "Allow",
             "Action": ["route53:ListHostedZones", "route53:ListHostedZonesByName"], "Resource": ["*"]},
        )
        self._pod_identity_role("cert-manager", CERT_MANAGER_NAMESPACE, "cert-manager", change_records)
        self._pod_identity_role("external-dns", EXTERNAL_DNS_NAMESPACE, "external-dns", change_records)

        cm_ns = self._namespace("cert-manager", CERT_MANAGER_NAMESPACE, on_nodes)
        cert_manager = self._release("cert-manager", CERT_MANAGER_NAMESPACE, {
            "crds": {"enabled": True}, "serviceAccount": {"name": "cert-manager"},
        }, [cm_ns])
        issuer = k8s.apiextensions.CustomResource(
            f"{self._name}-cluster-issuer", api_version="cert-manager.io/v1", kind="ClusterIssuer",
            metadata={"name": CLUSTER_ISSUER, "labels": platform_labels("certificates")},
            spec={"acme": {
                "server": ACME_SERVER,
                "privateKeySecretRef": {"name": f"{CLUSTER_ISSUER}-account"},
                "solvers": [{"selector": {"dnsZones": [domain]},
                             "dns01": {"route53": {"region": cfg.region, "hostedZoneID": zone.zone_id}}}],
            }},
            opts=self._k8s([cert_manager]))

        dns_ns = self._namespace("external-dns", EXTERNAL_DNS_NAMESPACE, on_nodes)
        external_dns = self._release("external-dns", EXTERNAL_DNS_NAMESPACE, {
            "provider": {"name": "aws"},
            "serviceAccount": {"name": "external-dns"},
            "sources": ["gateway-httproute", "gateway-grpcroute"],
            "domainFilters": [domain],
            "txtOwnerId": f"llm-serving-{cfg.environment}-{cfg.region}",
            "policy": "sync",
            "extraArgs": ["--zone-id-filter=$(ZONE_ID)"],
            "env": [{"name": "ZONE_ID", "value": zone.zone_id}, {"name": "AWS_DEFAULT_REGION", "value": cfg.region}],
        }, [dns_ns, gateway_crds])
        return issuer, external_dns
