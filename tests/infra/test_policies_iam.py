"""IAM: no wildcard actions or resources on S3, ECR and KMS."""

from __future__ import annotations

import json

import pytest

from policies.rules.iam import statement_problems, trust_problems
from tests.infra.policy_support import compliant_stack, fired, inputs_of, messages, write_compat

POLICY = "iam-no-wildcard-s3-ecr-kms"


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


@pytest.mark.parametrize(
    ("statement", "problem"),
    [
        ({"Action": "s3:*", "Resource": "arn:aws:s3:::models-prod/models/*"}, "wildcard action 's3:*'"),
        ({"Action": "s3:Get*", "Resource": "arn:aws:s3:::models-prod/models/*"}, "wildcard action 's3:Get*'"),
        ({"Action": "*", "Resource": "arn:aws:s3:::models-prod"}, "wildcard action '*'"),
        ({"Action": "s3:GetObject", "Resource": "*"}, "wildcard resource '*' for s3:GetObject"),
        ({"Action": "s3:GetObject", "Resource": "arn:aws:s3:::*/models/*"},
         "wildcard resource 'arn:aws:s3:::*/models/*'"),
        ({"Action": "ecr:BatchGetImage", "Resource": "arn:aws:ecr:us-east-1:123456789012:repository/*"},
         "wildcard resource"),
        ({"Action": "kms:Decrypt", "Resource": "arn:aws:kms:us-east-1:123456789012:key/*"}, "wildcard resource"),
        ({"NotAction": "iam:*", "Resource": "arn:aws:s3:::models-prod"}, "NotAction"),
        ({"Action": "s3:GetObject", "NotResource": "arn:aws:s3:::other/*"}, "NotResource"),
        ({"Action": ["ecr:GetAuthorizationToken", "ecr:BatchGetImage"], "Resource": "*"}, "wildcard resource"),
    ],
)
def test_statement_problems(statement, problem):
    found = statement_problems({"Effect": "Allow", **statement})
    assert any(problem in p for p in found), found


@pytest.mark.parametrize(
    "statement",
    [
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::models-prod/models/*"},
        {"Effect": "Allow", "Action": "ecr:GetAuthorizationToken", "Resource": "*"},  # has no resource-level form
        {"Effect": "Allow", "Action": "ec2:DescribeInstances", "Resource": "*"},  # not S3/ECR/KMS
        {"Effect": "Deny", "Action": "s3:*", "Resource": "*"},  # denies narrow, they never widen
        {"Effect": "Allow", "Action": "kms:Decrypt", "Resource": "arn:aws:kms:us-east-1:1:key/1234abcd"},
    ],
)
def test_statements_that_pass(statement):
    assert statement_problems(statement) == []


@pytest.mark.parametrize(
    ("type_", "inputs"),
    [
        ("aws:iam/policy:Policy", {"policy": {"Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}}),
        ("aws:iam/rolePolicy:RolePolicy", {"role": "r", "policy": json.dumps(
            {"Statement": [{"Sid": "All", "Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})}),
        ("aws:iam/role:Role", {"assumeRolePolicy": "{}", "inlinePolicies": [{"name": "wide", "policy": json.dumps(
            {"Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})}]}),
        ("aws:iam/rolePolicyAttachment:RolePolicyAttachment",
         {"role": "r", "policyArn": "arn:aws:iam::aws:policy/AmazonS3FullAccess"}),
        ("aws:iam/role:Role", {"assumeRolePolicy": "{}",
                               "managedPolicyArns": ["arn:aws:iam::aws:policy/AdministratorAccess"]}),
    ],
    ids=["policy-object", "role-policy-json", "role-inline", "managed-attachment", "role-managed-arns"],
)
def test_every_kind_of_identity_policy_is_checked(type_, inputs, compat):
    stack = compliant_stack()
    stack.add(type_, "wide", inputs)
    findings = stack.evaluate(compat)
    assert fired(findings) == {POLICY}
    assert {f.resource for f in findings} == {"wide"}
    assert all(("wildcard" in m or "managed policy" in m) for m in messages(findings, POLICY))


def test_eks_node_pull_policy_is_allowed(compat):
    stack = compliant_stack()
    stack.add("aws:iam/rolePolicyAttachment:RolePolicyAttachment", "node-ecr",
              {"role": "node", "policyArn": "arn:aws:iam::aws:policy/AmazonEC2ContainerRegistryReadOnly"})
    assert stack.evaluate(compat) == []


def test_invalid_document_is_reported(compat):
    stack = compliant_stack()
    stack.add("aws:iam/rolePolicy:RolePolicy", "broken", {"role": "r", "policy": "{nope"})
    assert any("is not valid JSON" in m for m in messages(stack.evaluate(compat), POLICY))


# -- IRSA trust ----------------------------------------------------------------------------------------------------

OIDC = "oidc.eks.us-east-1.amazonaws.com/id/ABC"


def _web_identity(condition):
    return {"Effect": "Allow", "Action": "sts:AssumeRoleWithWebIdentity",
            "Principal": {"Federated": f"arn:aws:iam::1:oidc-provider/{OIDC}"}, "Condition": condition}


@pytest.mark.parametrize(
    ("condition", "problem"),
    [
        ({"StringEquals": {f"{OIDC}:aud": "sts.amazonaws.com"}}, "every service account of the cluster"),
        ({"StringLike": {f"{OIDC}:sub": "system:serviceaccount:*"}}, "every service account of the cluster"),
        ({"StringEquals": {f"{OIDC}:sub": "system:serviceaccount:llm-serving:*", f"{OIDC}:aud": "sts.amazonaws.com"}},
         "is not one service account"),
        ({"StringEquals": {f"{OIDC}:sub": "system:serviceaccount:llm-serving:model-server"}},
         "the :aud condition must be exactly sts.amazonaws.com (got none)"),
    ],
    ids=["no-sub", "string-like-wildcard", "namespace-wildcard", "no-aud"],
)
def test_irsa_trust_problems(condition, problem):
    found = trust_problems(_web_identity(condition))
    assert any(problem in p for p in found), found


def test_trust_open_to_everyone():
    assert trust_problems({"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}) == [
        "the trust policy lets any principal assume the role"]


def test_service_trust_is_fine():
    assert trust_problems({"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
                           "Action": "sts:AssumeRole"}) == []


def test_irsa_role_with_loose_trust(compat):
    stack = compliant_stack()
    doc = json.loads(inputs_of(stack, "model-server")["assumeRolePolicy"])
    doc["Statement"][0]["Condition"]["StringEquals"][f"{OIDC}:sub"] = "system:serviceaccount:llm-serving:*"
    inputs_of(stack, "model-server")["assumeRolePolicy"] = json.dumps(doc)
    findings = stack.evaluate(compat)
    assert fired(findings) == {"iam-irsa-trust-scoped"}
    assert messages(findings, "iam-irsa-trust-scoped") == [
        "role 'model-server' trust statement #0: 'system:serviceaccount:llm-serving:*' is not one service account "
        "(system:serviceaccount:<namespace>:<name>)"]
