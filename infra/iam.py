"""IAM documents and IRSA roles. Policies are JSON built here (not getPolicyDocument invokes) so that the exact
statements are visible in the resources' inputs to tests and policies. No statement uses a bare "*" resource, except
for actions AWS does not scope by resource at all (UNSCOPABLE_ACTIONS, read-only lookups the node autoscaler and
ExternalDNS need)."""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

# Read-only actions without resource-level permissions: IAM only accepts "*" for them.
UNSCOPABLE_ACTIONS = frozenset({
    "ec2:DescribeAvailabilityZones", "ec2:DescribeImages", "ec2:DescribeInstances",
    "ec2:DescribeInstanceTypeOfferings", "ec2:DescribeInstanceTypes", "ec2:DescribeLaunchTemplates",
    "ec2:DescribeSecurityGroups", "ec2:DescribeSubnets", "ec2:DescribeSpotPriceHistory",
    "ec2:DescribeCapacityReservations", "pricing:GetProducts", "route53:ListHostedZones",
    "route53:ListHostedZonesByName",
})


def policy_document(*statements: dict[str, Any]) -> pulumi.Output[str]:
    return pulumi.Output.json_dumps({"Version": "2012-10-17", "Statement": list(statements)})


def service_trust(service: str) -> pulumi.Output[str]:
    return policy_document({"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"})


def irsa_trust(oidc_provider_arn: pulumi.Input[str], oidc_issuer_url: pulumi.Input[str], namespace: str,
               service_account: str) -> pulumi.Output[str]:
    """Only the one service account in the one namespace may assume the role (IAM Roles for Service Accounts)."""
    issuer = pulumi.Output.from_input(oidc_issuer_url).apply(lambda url: url.removeprefix("https://"))
    condition = issuer.apply(lambda i: {"StringEquals": {
        f"{i}:sub": f"system:serviceaccount:{namespace}:{service_account}",
        f"{i}:aud": "sts.amazonaws.com",
    }})
    return policy_document({
        "Effect": "Allow",
        "Principal": {"Federated": oidc_provider_arn},
        "Action": "sts:AssumeRoleWithWebIdentity",
        "Condition": condition,
    })


def role_with_policy(name: str, trust: pulumi.Input[str], policy: pulumi.Input[str] | None,
                     managed_policy_arns: list[str] = (), tags: dict[str, str] | None = None,
                     opts: pulumi.ResourceOptions | None = None) -> aws.iam.Role:
    role = aws.iam.Role(name, assume_role_policy=trust, tags=tags, opts=opts)
    child = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(parent=role))
    if policy is not None:
        aws.iam.RolePolicy(name, role=role.id, policy=policy, opts=child)
    for i, arn in enumerate(managed_policy_arns):
        aws.iam.RolePolicyAttachment(f"{name}-{i}", role=role.name, policy_arn=arn, opts=child)
    return role


def irsa_service_account(role_name: str, account_name: str, *, namespace: str, service_account: str,
                         labels: dict[str, str], oidc_provider_arn: pulumi.Input[str],
                         oidc_issuer_url: pulumi.Input[str], policy: pulumi.Input[str], tags: dict[str, str],
                         role_opts: pulumi.ResourceOptions, account_opts: pulumi.ResourceOptions,
                         ) -> tuple[aws.iam.Role, k8s.core.v1.ServiceAccount]:
    """A ServiceAccount and the IAM role only it may assume (IRSA), from one namespace and name: the role's trust
    names the account, the account carries the role's ARN; no API token mounted (the pods call no Kubernetes API).
    `role_name` and `account_name` are the Pulumi resource names."""
    role = role_with_policy(role_name, irsa_trust(oidc_provider_arn, oidc_issuer_url, namespace, service_account),
                            policy, (), tags, role_opts)
    account = k8s.core.v1.ServiceAccount(
        account_name, metadata={"name": service_account, "namespace": namespace, "labels": labels,
                                "annotations": {"eks.amazonaws.com/role-arn": role.arn}},
        automount_service_account_token=False, opts=account_opts)
    return role, account
