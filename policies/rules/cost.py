"""Cost allocation: every cost-bearing resource says which team, model and environment pays for it.

AWS resources carry tags (their own or the provider's defaultTags); model servers carry pod labels, which EKS
split cost allocation imports as cost allocation tags for the GPU-hours they hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

from .._props import get, json_document, labels
from ..context import PolicyContextError, stack_context
from ..index import is_serving_workload
from ..workload import DEPLOYMENT, NAME_LABEL, pod_template

AWS_TAG_KEYS = ("team", "env")
SERVING_LABEL_KEYS = ("team", "env", "model")
# Resources that cost money by themselves; any other AWS resource that takes tags is checked when it sets some.
COST_BEARING = frozenset({
    "aws:s3/bucket:Bucket",
    "aws:fsx/lustreFileSystem:LustreFileSystem",
    "aws:eks/nodeGroup:NodeGroup",
    "aws:eks/cluster:Cluster",
    "aws:ec2/natGateway:NatGateway",
    "aws:ec2/eip:Eip",
    "aws:ec2/vpc:Vpc",
    "aws:kms/key:Key",
    "aws:ecr/repository:Repository",
})


def _default_tags(args: ResourceValidationArgs) -> dict[str, Any]:
    if args.provider is None:
        return {}
    raw = get(args.provider.props, "defaultTags")
    try:
        doc = json_document(raw) if raw is not None else {}
    except ValueError:
        return {}
    tags = get(doc, "tags")
    return dict(tags) if isinstance(tags, Mapping) else {}


def _validate_aws_tags(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not args.resource_type.startswith("aws:"):
        return
    own = get(args.props, "tags")
    if args.resource_type not in COST_BEARING and own is None:
        return
    tags = {**_default_tags(args), **(own if isinstance(own, Mapping) else {})}
    missing = [k for k in AWS_TAG_KEYS if not tags.get(k)]
    if missing:
        report(f"{args.resource_type.rsplit(':', 1)[-1]} {args.name!r} lacks the cost allocation tag(s) "
               f"{', '.join(missing)} (own tags or the provider's defaultTags)", None)
    try:
        env = stack_context(args).env
    except PolicyContextError:
        return
    if tags.get("env") and tags["env"] != env:
        report(f"{args.resource_type.rsplit(':', 1)[-1]} {args.name!r} is tagged env={tags['env']!r} in a {env} "
               f"stack", None)


def _validate_serving_labels(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != DEPLOYMENT or not is_serving_workload(args.props):
        return
    pod_labels = labels(pod_template(args.props))
    present = {k: pod_labels.get(k) for k in SERVING_LABEL_KEYS}
    present["model"] = present["model"] or pod_labels.get(NAME_LABEL)
    missing = [k for k, v in present.items() if not v]
    if missing:
        report(f"Deployment {args.name!r}: its pods lack the cost allocation label(s) {', '.join(missing)}, so "
               f"their GPU-hours cannot be charged back", None)


cost_allocation_tags = ResourceValidationPolicy(
    name="cost-allocation-tags",
    description="Cost-bearing AWS resources carry team and env tags; model servers carry team, env and model labels.",
    validate=[_validate_aws_tags, _validate_serving_labels],
    enforcement_level=EnforcementLevel.ADVISORY,
)

POLICIES = [cost_allocation_tags]
