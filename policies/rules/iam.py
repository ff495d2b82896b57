"""IAM: no wildcard actions or resources on S3, ECR and KMS in identity policies.

Serving pods may read only the model prefix (IRSA), nodes may pull only from the stack's repositories, and keys
are named: a wildcard on any of these services turns one leaked pod credential into access to every model and
every key in the account. Checked: inline and managed identity policies (Allow statements), and attachments of AWS
managed policies that grant these services on every resource.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

from .._props import as_list, get, iter_mappings, json_document

GUARDED_SERVICES = ("s3", "ecr", "kms")
POLICY_DOCUMENT_TYPES = (
    "aws:iam/policy:Policy",
    "aws:iam/rolePolicy:RolePolicy",
    "aws:iam/userPolicy:UserPolicy",
    "aws:iam/groupPolicy:GroupPolicy",
)
ROLE = "aws:iam/role:Role"
ATTACHMENT_TYPES = (
    "aws:iam/rolePolicyAttachment:RolePolicyAttachment",
    "aws:iam/userPolicyAttachment:UserPolicyAttachment",
    "aws:iam/groupPolicyAttachment:GroupPolicyAttachment",
    "aws:iam/policyAttachment:PolicyAttachment",
)
# Actions that have no resource-level permissions: AWS only accepts Resource "*" for them.
RESOURCE_STAR_ONLY = frozenset({
    "ecr:getauthorizationtoken",
    "s3:listallmybuckets",
    "kms:listkeys",
    "kms:listaliases",
    "kms:createkey",
})
# AWS managed policies that grant S3, ECR or KMS on every resource. AmazonEC2ContainerRegistryReadOnly and
# ...PullOnly stay allowed: EKS requires one of them on the node role to pull images.
BROAD_MANAGED_POLICIES = frozenset({
    "AdministratorAccess",
    "PowerUserAccess",
    "AmazonS3FullAccess",
    "AmazonS3ReadOnlyAccess",
    "AmazonEC2ContainerRegistryFullAccess",
    "AmazonEC2ContainerRegistryPowerUser",
    "AWSKeyManagementServicePowerUser",
})
_WILDCARD_ONLY = re.compile(r"^[*?/]*$")


def _service(action: str) -> str:
    return action.split(":", 1)[0].lower() if ":" in action else action.lower()


def _is_wildcard_resource(resource: str) -> bool:
    if resource == "*":
        return True
    parts = resource.split(":", 5)
    if len(parts) < 6 or parts[0] != "arn":
        return False
    service, name = parts[2], parts[5]
    if service == "s3":
        bucket = name.split("/", 1)[0]
        return "*" in bucket or "?" in bucket
    # ECR "repository/<name>", KMS "key/<id>" or "alias/<name>": the name part must name something.
    _, _, tail = name.partition("/")
    return bool(_WILDCARD_ONLY.match(tail if "/" in name else name))


def statement_problems(statement: Mapping[str, Any]) -> list[str]:
    """What is wrong with one policy statement, for S3/ECR/KMS; empty when nothing is."""
    if statement.get("Effect") != "Allow":
        return []
    problems = []
    if "NotAction" in statement:
        problems.append("an Allow with NotAction grants every action it does not list")
    if "NotResource" in statement:
        problems.append("an Allow with NotResource grants every resource it does not list")
    actions = [str(a) for a in as_list(statement.get("Action"))]
    guarded = [a for a in actions if a == "*" or _service(a) in GUARDED_SERVICES]
    for action in guarded:
        if action == "*" or "*" in action or "?" in action:
            problems.append(f"wildcard action {action!r}")
    if guarded and not all(a.lower() in RESOURCE_STAR_ONLY for a in guarded):
        for resource in as_list(statement.get("Resource")):
            if isinstance(resource, str) and _is_wildcard_resource(resource):
                problems.append(f"wildcard resource {resource!r} for {', '.join(guarded)}")
    return problems


def _documents(args: ResourceValidationArgs) -> Iterable[tuple[str, Any]]:
    if args.resource_type in POLICY_DOCUMENT_TYPES:
        yield args.name, get(args.props, "policy")
    elif args.resource_type == ROLE:
        for inline in iter_mappings(get(args.props, "inlinePolicies")):
            yield f"{args.name}/{inline.get('name') or 'inline'}", inline.get("policy")


def _validate_documents(args: ResourceValidationArgs, report: ReportViolation) -> None:
    for source, raw in _documents(args):
        if raw is None:
            continue
        try:
            doc = json_document(raw)
        except ValueError as err:
            report(f"policy {source!r} is not valid JSON: {err}", None)
            continue
        for i, statement in enumerate(iter_mappings(get(doc, "Statement"))):
            label = statement.get("Sid") or f"#{i}"
            for problem in statement_problems(statement):
                report(f"policy {source!r} statement {label}: {problem} (S3, ECR and KMS must be named)", None)


def _validate_attachments(args: ResourceValidationArgs, report: ReportViolation) -> None:
    arns: list[str] = []
    if args.resource_type in ATTACHMENT_TYPES:
        arns = [str(get(args.props, "policyArn") or "")]
    elif args.resource_type == ROLE:
        arns = [str(a) for a in as_list(get(args.props, "managedPolicyArns"))]
    for arn in arns:
        if arn.startswith("arn:aws:iam::aws:policy/") and arn.rsplit("/", 1)[-1] in BROAD_MANAGED_POLICIES:
            report(
                f"{args.name!r} attaches the AWS managed policy {arn}, which grants S3/ECR/KMS on every resource: "
                f"write a policy naming the bucket prefix, repository or key",
                None,
            )


_SERVICE_ACCOUNT = re.compile(r"^system:serviceaccount:[a-z0-9-]+:[a-z0-9.-]+$")


def trust_problems(statement: Mapping[str, Any]) -> list[str]:
    """What lets more than one Kubernetes service account (or anyone) assume a role through IRSA."""
    if statement.get("Effect") != "Allow":
        return []
    principal = statement.get("Principal")
    if principal == "*" or (isinstance(principal, Mapping) and "*" in as_list(principal.get("AWS"))):
        return ["the trust policy lets any principal assume the role"]
    if "sts:AssumeRoleWithWebIdentity" not in as_list(statement.get("Action")):
        return []
    equals = get(statement, "Condition", "StringEquals") or {}
    subs = [v for k, vs in equals.items() if str(k).endswith(":sub") for v in as_list(vs)]
    auds = [v for k, vs in equals.items() if str(k).endswith(":aud") for v in as_list(vs)]
    problems = []
    if not subs:
        problems.append("no StringEquals condition on the OIDC provider's :sub, so every service account of the "
                        "cluster may assume the role")
    problems += [f"{sub!r} is not one service account (system:serviceaccount:<namespace>:<name>)"
                 for sub in subs if not _SERVICE_ACCOUNT.match(str(sub))]
    if auds != ["sts.amazonaws.com"]:
        problems.append(f"the :aud condition must be exactly sts.amazonaws.com (got {auds or 'none'})")
    return problems


def _validate_trust(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != ROLE or get(args.props, "assumeRolePolicy") is None:
        return
    try:
        doc = json_document(get(args.props, "assumeRolePolicy"))
    except ValueError as err:
        report(f"role {args.name!r}: assumeRolePolicy is not valid JSON: {err}", None)
        return
    for i, statement in enumerate(iter_mappings(get(doc, "Statement"))):
        for problem in trust_problems(statement):
            report(f"role {args.name!r} trust statement {statement.get('Sid') or f'#{i}'}: {problem}", None)


iam_no_wildcards = ResourceValidationPolicy(
    name="iam-no-wildcard-s3-ecr-kms",
    description="Identity policies name their S3, ECR and KMS actions and resources: no wildcards.",
    validate=[_validate_documents, _validate_attachments],
    enforcement_level=EnforcementLevel.MANDATORY,
)

iam_irsa_trust = ResourceValidationPolicy(
    name="iam-irsa-trust-scoped",
    description="Roles assumed through IRSA trust exactly one Kubernetes service account, with the STS audience.",
    validate=_validate_trust,
    enforcement_level=EnforcementLevel.MANDATORY,
)

POLICIES = [iam_no_wildcards, iam_irsa_trust]
