"""S3 rules: each against the compliant synthetic stack and against one broken setting.

The resources are synthetic but shaped exactly as the mock runtime records them (`tests/infra/policy_support.py`);
the policy objects and `pulumi_policy`'s argument classes are the real ones.
"""

from __future__ import annotations

import json

import pytest

from tests.infra.policy_support import compliant_stack, fired, inputs_of, messages, write_compat


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


def _policy_doc(stack) -> dict:
    return json.loads(inputs_of(stack, "models-policy")["policy"])


def _set_policy_doc(stack, doc) -> None:
    inputs_of(stack, "models-policy")["policy"] = json.dumps(doc)


def _no_sse(stack):
    stack.remove("models-sse")


def _bad_algorithm(stack):
    inputs_of(stack, "models-sse")["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] = "none"


def _suspended(stack):
    inputs_of(stack, "models-versioning")["versioningConfiguration"]["status"] = "Suspended"


def _no_versioning(stack):
    stack.remove("models-versioning")


def _no_pab(stack):
    stack.remove("models-pab")


def _pab_policy_off(stack):
    inputs_of(stack, "models-pab")["blockPublicPolicy"] = False


def _no_policy(stack):
    stack.remove("models-policy")


def _tls_allows(stack):
    doc = _policy_doc(stack)
    doc["Statement"][0]["Effect"] = "Allow"
    _set_policy_doc(stack, doc)


def _tls_objects_only(stack):
    doc = _policy_doc(stack)
    doc["Statement"][0]["Resource"] = [r for r in doc["Statement"][0]["Resource"] if r.endswith("/*")]
    _set_policy_doc(stack, doc)


def _aes256(stack):
    inputs_of(stack, "models-sse")["rules"][0]["applyServerSideEncryptionByDefault"] = {"sseAlgorithm": "AES256"}


def _no_lifecycle(stack):
    stack.remove("models-lifecycle")


CASES = [
    (_no_sse, "s3-bucket-encryption", "bucket 'models' has no default encryption"),
    (_bad_algorithm, "s3-bucket-encryption", "sseAlgorithm 'none' is not one of"),
    (_suspended, "s3-bucket-versioning", "is not versioned ('Suspended')"),
    (_no_versioning, "s3-bucket-versioning", "is not versioned (no aws.s3.BucketVersioning)"),
    (_no_pab, "s3-public-access-block", "has no aws.s3.BucketPublicAccessBlock"),
    (_pab_policy_off, "s3-public-access-block", "leaves blockPublicPolicy not true"),
    (_no_policy, "s3-tls-only", "has no bucket policy"),
    (_tls_allows, "s3-tls-only", "without a TLS-only statement"),
    (_tls_objects_only, "s3-tls-only", "without a TLS-only statement"),
    (_aes256, "s3-kms-encryption", "is encrypted with AES256 only"),
    (_no_lifecycle, "s3-noncurrent-version-expiry", "keeps noncurrent object versions forever"),
]


@pytest.mark.parametrize(("breakage", "policy", "message"), CASES, ids=[c[0].__name__.strip("_") for c in CASES])
def test_rule_catches_its_violation(breakage, policy, message, compat):
    stack = compliant_stack()
    assert policy not in fired(stack.evaluate(compat))
    breakage(stack)
    findings = stack.evaluate(compat)
    assert fired(findings) == {policy}
    assert any(message in m for m in messages(findings, policy)), messages(findings, policy)
    assert all(f.resource == "models" for f in findings)


def test_side_resources_join_their_own_bucket_only(compat):
    """A second bucket without any settings is reported on its own; the first bucket's settings do not cover it."""
    stack = compliant_stack()
    stack.add("aws:s3/bucket:Bucket", "logs", {"bucket": "logs-prod", "tags": {"team": "t", "env": "prod"}})
    findings = stack.evaluate(compat)
    assert {f.resource for f in findings} == {"logs"}
    assert {"s3-bucket-encryption", "s3-bucket-versioning", "s3-public-access-block", "s3-tls-only"} <= fired(findings)


def test_join_by_bucket_name_when_no_dependency_was_recorded(compat):
    stack = compliant_stack()
    for name in ("models-sse", "models-versioning", "models-pab", "models-policy", "models-lifecycle"):
        stack.get(name).dependencies.clear()
    assert stack.evaluate(compat) == []


def test_inline_bucket_settings_count(compat):
    """The deprecated inline arguments of aws.s3.Bucket are judged on what they set."""
    stack = compliant_stack()
    stack.remove("models-sse")
    stack.remove("models-versioning")
    inputs_of(stack, "models").update({
        "serverSideEncryptionConfiguration": {"rule": {"applyServerSideEncryptionByDefault": {
            "sseAlgorithm": "aws:kms"}}},
        "versioning": {"enabled": True},
    })
    assert stack.evaluate(compat) == []


def test_invalid_bucket_policy_json_is_reported(compat):
    stack = compliant_stack()
    inputs_of(stack, "models-policy")["policy"] = "{not json"
    assert any("is not valid JSON" in m for m in messages(stack.evaluate(compat), "s3-tls-only"))


# -- replication of KMS-encrypted objects --------------------------------------------------------------------------


def _with_replication(stack, **rule):
    replication_rule = {
        "id": "to-us-west-2", "status": "Enabled", "filter": {"prefix": ""},
        "deleteMarkerReplication": {"status": "Enabled"},
        "sourceSelectionCriteria": {"sseKmsEncryptedObjects": {"status": "Enabled"}},
        "destination": {"bucket": "arn:aws:s3:::models-prod-us-west-2",
                        "encryptionConfiguration": {"replicaKmsKeyId": "arn:aws:kms:us-west-2:1:key/k"}},
    }
    replication_rule.update(rule)
    stack.add("aws:s3/bucketReplicationConfig:BucketReplicationConfig", "models-replication", {
        "bucket": "models-prod-us-east-1", "role": "arn:aws:iam::1:role/replication", "rules": [replication_rule]},
        depends_on=["models"])
    return stack


def test_replication_of_kms_objects(compat):
    assert _with_replication(compliant_stack()).evaluate(compat) == []
    stack = _with_replication(compliant_stack(), sourceSelectionCriteria={},
                              destination={"bucket": "arn:aws:s3:::models-prod-us-west-2"})
    findings = stack.evaluate(compat)
    assert fired(findings) == {"s3-replication-kms-objects"}
    shown = messages(findings, "s3-replication-kms-objects")
    assert any("'to-us-west-2' does not select SSE-KMS objects" in m and "silently skips" in m for m in shown)
    assert any("names no destination.encryptionConfiguration.replicaKmsKeyId" in m for m in shown)


def test_disabled_replication_rule_is_not_judged(compat):
    stack = _with_replication(compliant_stack(), status="Disabled", sourceSelectionCriteria={})
    assert stack.evaluate(compat) == []
