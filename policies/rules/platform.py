"""Cluster and registry settings a reviewer checks beside the model path."""

from __future__ import annotations

from pulumi_policy import (
    EnforcementLevel,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from .._props import as_bool, as_list, get, iter_mappings
from ..context import stack_context
from ..index import StackIndex

CLUSTER = "aws:eks/cluster:Cluster"
REPOSITORY = "aws:ecr/repository:Repository"
KMS_KEY = "aws:kms/key:Key"


def _validate_private_endpoint(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != CLUSTER:
        return
    ctx = stack_context(args)
    if not ctx.is_prod:
        return
    # The EKS API defaults to a public endpoint when endpointPublicAccess is unset.
    public = as_bool(get(args.props, "vpcConfig", "endpointPublicAccess"))
    cidrs = [str(c) for c in as_list(get(args.props, "vpcConfig", "publicAccessCidrs"))]
    # The one exception: a first update's bootstrap window (cluster.apiAccess.bootstrapPublicCidrs), public only to
    # the runner's own addresses.
    bootstrap = get(ctx.config.get("cluster") or {}, "apiAccess", "bootstrapPublicCidrs")
    if public is True and bootstrap and cidrs and not any(c.endswith("/0") for c in cidrs):
        return
    if public is not False:
        report(f"EKS cluster {args.name!r} in prod stack {ctx.stack!r} has a public API endpoint "
               f"(vpcConfig.endpointPublicAccess {public if public is not None else 'unset, which means true'}): "
               f"prod clusters are reachable from the VPC only", None)
    if as_bool(get(args.props, "vpcConfig", "endpointPrivateAccess")) is not True:
        report(f"EKS cluster {args.name!r} in prod stack {ctx.stack!r} lacks vpcConfig.endpointPrivateAccess: true",
               None)


def _validate_repository(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != REPOSITORY:
        return
    if get(args.props, "imageTagMutability") != "IMMUTABLE":
        report(f"ECR repository {args.name!r}: tags are mutable; set imageTagMutability IMMUTABLE so a tag always "
               f"names the digest that was reviewed", None)
    if as_bool(get(args.props, "imageScanningConfiguration", "scanOnPush")) is not True:
        report(f"ECR repository {args.name!r}: images are not scanned on push "
               f"(imageScanningConfiguration.scanOnPush)", None)


AUDIT_LOG_TYPES = ("api", "audit", "authenticator")


def _validate_cluster_hardening(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != CLUSTER:
        return
    resources = [r for c in iter_mappings(get(args.props, "encryptionConfig")) for r in as_list(c.get("resources"))]
    if "secrets" not in resources:
        report(f"EKS cluster {args.name!r} does not envelope-encrypt Kubernetes secrets with a KMS key "
               f"(encryptionConfig resources: [secrets])", None)
    logs = [str(t) for t in as_list(get(args.props, "enabledClusterLogTypes"))]
    missing = [t for t in AUDIT_LOG_TYPES if t not in logs]
    if missing:
        report(f"EKS cluster {args.name!r} does not ship control plane logs {', '.join(missing)}: who changed "
               f"what in the cluster cannot be traced", None)


def _validate_key_rotation(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != KMS_KEY:
        return
    spec = get(args.props, "customerMasterKeySpec") or get(args.props, "keySpec") or "SYMMETRIC_DEFAULT"
    if spec == "SYMMETRIC_DEFAULT" and as_bool(get(args.props, "enableKeyRotation")) is not True:
        report(f"KMS key {args.name!r} does not rotate (enableKeyRotation)", None)


SG_INGRESS_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
DOCKER_IMAGE = "docker-build:index:Image"
ECR_REPLICATION = "aws:ecr/replicationConfiguration:ReplicationConfiguration"
STACK_REFERENCE = "pulumi:pulumi:StackReference"


def _validate_one_build(args: StackValidationArgs, report: ReportViolation) -> None:
    """Every region runs the bytes the home region built: the home region builds and replicates its repository to
    every replica region; any other region builds nothing and reads the home region's digest."""
    index = StackIndex(args.resources)
    ctx = stack_context(args)
    region = ctx.stack.split("-", 1)[1] if "-" in ctx.stack else None
    home = ctx.config.get("homeRegion")
    if not home or not region:
        return
    images = index.of_type(DOCKER_IMAGE)
    if region != home:
        for image in images:
            report(f"stack {ctx.stack!r} builds its own serving image ({image.name!r}) outside the home region "
                   f"{home}: its digest differs from every other region's; run the home region's digest, replicated "
                   f"by ECR (infra/registry.py)", image.urn)
        if not any(str(get(r.props, "name") or r.name).endswith(f"-{home}") for r in index.of_type(STACK_REFERENCE)):
            report(f"stack {ctx.stack!r} does not read its home region's serving image (no StackReference to the "
                   f"{home} stack)", None)
        return
    wanted = {str(get(r, "region")) for r in as_list(get(ctx.config.get("modelStorage") or {}, "replicaRegions"))}
    if not wanted or not images:
        return
    replicated = {str(get(d, "region")) for c in index.of_type(ECR_REPLICATION)
                  for rule in as_list(get(c.props, "replicationConfiguration", "rules"))
                  for d in as_list(get(rule, "destinations"))}
    missing = sorted(wanted - replicated)
    if missing:
        report(f"stack {ctx.stack!r} builds the serving image but does not replicate it to {', '.join(missing)} "
               f"(no ECR replication rule names them): those regions cannot run its digest", images[0].urn)


def _validate_api_reachable(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for cluster in index.of_type(CLUSTER):
        if as_bool(get(cluster.props, "vpcConfig", "endpointPublicAccess")) is not False:
            continue  # public (dev, or a bootstrap window restricted to the runner): reachable from outside
        rules = [r for r in index.of_type(SG_INGRESS_RULE) if index.depends_on(r, cluster)
                 and (get(r.props, "fromPort") or 0) <= 443 <= (get(r.props, "toPort") or 0)]
        if not rules:
            report(f"EKS cluster {cluster.name!r} has a private endpoint only and no security group rule lets a "
                   f"runner reach it on TCP 443: the Kubernetes objects of this very update cannot be created "
                   f"(set cluster.apiAccess.runnerCidrs, or bootstrapPublicCidrs for a first update; "
                   f"docs/first-update.md)", cluster.urn)


eks_api_reachable = StackValidationPolicy(
    name="eks-api-reachable-from-runner",
    description="A private-only EKS API endpoint has a security group rule admitting the update's runner on 443.",
    validate=_validate_api_reachable,
    enforcement_level=EnforcementLevel.ADVISORY,
)

ecr_one_build_replicated = StackValidationPolicy(
    name="ecr-one-build-replicated",
    description="Only the home region builds the serving image and replicates it to every replica region; the "
                "others run its digest.",
    validate=_validate_one_build,
    enforcement_level=EnforcementLevel.MANDATORY,
)

eks_private_endpoint = ResourceValidationPolicy(
    name="eks-private-endpoint-in-prod",
    description="Prod EKS clusters expose their API on a private endpoint only.",
    validate=_validate_private_endpoint,
    enforcement_level=EnforcementLevel.MANDATORY,
)
ecr_immutable_scanned = ResourceValidationPolicy(
    name="ecr-immutable-and-scanned",
    description="ECR repositories have immutable tags and scan images on push.",
    validate=_validate_repository,
    enforcement_level=EnforcementLevel.ADVISORY,
)

eks_cluster_hardening = ResourceValidationPolicy(
    name="eks-secrets-encryption-and-audit-logs",
    description="EKS clusters encrypt secrets with KMS and ship api/audit/authenticator logs.",
    validate=_validate_cluster_hardening,
    enforcement_level=EnforcementLevel.ADVISORY,
)
kms_key_rotation = ResourceValidationPolicy(
    name="kms-key-rotation",
    description="Symmetric KMS keys rotate automatically.",
    validate=_validate_key_rotation,
    enforcement_level=EnforcementLevel.ADVISORY,
)

POLICIES = [eks_private_endpoint, eks_api_reachable, ecr_one_build_replicated, ecr_immutable_scanned,
            eks_cluster_hardening, kms_key_rotation]
