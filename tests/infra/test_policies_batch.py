"""batch-store-isolated (policies/rules/batch.py): against the compliant synthetic stack with a batch bucket and a
worker as infra/batch.py renders them, and against each way of breaking them. The shipped stacks' renderings pass
it in test_policies_stacks.py."""

from __future__ import annotations

import json

import pytest

from policies.rules.batch import batch_store_isolated
from tests.infra.policy_support import compliant_stack, fired, inputs_of, messages, write_compat

BUCKET = "models-prod-us-east-1-batch"
ARN = f"arn:aws:s3:::{BUCKET}"
POLICY = "batch-store-isolated"


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


def _with_batch(stack):
    stack.add("aws:s3/bucket:Bucket", "batch-bucket", {"bucket": BUCKET, "tags": {}})
    stack.add("aws:iam/role:Role", "batch-llama-role", {"assumeRolePolicy": json.dumps({"Statement": [{
        "Effect": "Allow", "Action": "sts:AssumeRoleWithWebIdentity",
        "Condition": {"StringEquals": {"oidc.example/id/X:sub": "system:serviceaccount:llm:llama-batch-worker",
                                       "oidc.example/id/X:aud": "sts.amazonaws.com"}}}]})})
    policy = {
        "Version": "2012-10-17", "Statement": [
            {"Sid": "ThisModelsBatches", "Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"],
             "Resource": [f"{ARN}/llama/*"]},
            {"Sid": "ListThisModelsBatches", "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [ARN],
             "Condition": {"StringLike": {"s3:prefix": ["llama/*"]}}},
            {"Sid": "UseTheBatchKey", "Effect": "Allow", "Action": ["kms:Decrypt"], "Resource": ["arn:key"]}]}
    stack.add("aws:iam/rolePolicy:RolePolicy", "batch-llama-role-policy",
              {"role": "batch-llama-role", "policy": json.dumps(policy)}, depends_on=["batch-llama-role"])
    return stack


def _statements(stack) -> list[dict]:
    return json.loads(inputs_of(stack, "batch-llama-role-policy")["policy"])["Statement"]


def _set_statements(stack, statements) -> None:
    inputs_of(stack, "batch-llama-role-policy")["policy"] = json.dumps({"Statement": statements})


def test_the_rendered_shape_passes(compat):
    assert POLICY not in fired(_with_batch(compliant_stack()).evaluate(compat, policies=[batch_store_isolated]))


def _replicated(stack):
    stack.add("aws:s3/bucketReplicationConfig:BucketReplicationConfig", "batch-replication",
              {"bucket": BUCKET, "role": "arn:role", "rules": []}, depends_on=["batch-bucket"])


def _on_the_model_cache(stack):
    stack.add("aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation", "batch-dra",
              {"dataRepositoryPath": f"s3://{BUCKET}/", "fileSystemPath": "/batch", "fileSystemId": "fs-1"})


def _reads_the_model_bucket(stack):
    statements = _statements(stack)
    statements[0]["Resource"].append("arn:aws:s3:::models-prod-us-east-1/*")
    _set_statements(stack, statements)


def _reads_another_models_batches(stack):
    statements = _statements(stack)
    statements[0]["Resource"] = [f"{ARN}/*"]
    _set_statements(stack, statements)


def _lists_everything(stack):
    statements = _statements(stack)
    del statements[1]["Condition"]
    _set_statements(stack, statements)


@pytest.mark.parametrize(("breaks", "says"), [
    (_replicated, "is replicated by 'batch-replication'"),
    (_on_the_model_cache, "data repository association 'batch-dra'"),
    (_reads_the_model_bucket, "arn:aws:s3:::models-prod-us-east-1/*, outside llama's prefix"),
    (_reads_another_models_batches, f"{ARN}/*, outside llama's prefix"),
    (_lists_everything, "lists the batch bucket beyond llama/"),
])
def test_each_break_is_named(compat, breaks, says):
    stack = _with_batch(compliant_stack())
    breaks(stack)
    findings = stack.evaluate(compat, policies=[batch_store_isolated])
    assert POLICY in fired(findings)
    assert any(says in m for m in messages(findings, POLICY)), messages(findings, POLICY)


def test_a_serving_pod_may_name_s3_only_for_its_batch_store(compat):
    from policies.rules.serving import serving_no_download
    from tests.infra.policy_support import container

    stack = compliant_stack()
    container(stack)["env"].append({"name": "LLM_SERVING_BATCH_STORE", "value": f"s3://{BUCKET}/llama"})
    assert "serving-no-download-at-start" not in fired(stack.evaluate(compat, policies=[serving_no_download]))
    container(stack)["env"].append({"name": "LLM_SERVING_WEIGHTS", "value": "s3://models-prod-us-east-1/w"})
    findings = stack.evaluate(compat, policies=[serving_no_download])
    assert any("LLM_SERVING_WEIGHTS" in m for m in messages(findings, "serving-no-download-at-start"))
