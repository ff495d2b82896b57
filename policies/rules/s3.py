"""S3: every bucket encrypted, versioned, closed to the public, reachable over TLS only.

In pulumi-aws v7 these settings are separate resources that name the bucket by its id, so the rules are stack
policies that join each bucket to its side resources (`StackIndex.referenced`). The deprecated inline arguments
of `aws.s3.Bucket` count as well, so a bucket configured either way is judged on what it really gets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pulumi_policy import EnforcementLevel, PolicyResource, ReportViolation, StackValidationArgs, StackValidationPolicy

from .._props import as_bool, as_list, get, iter_mappings, json_document
from ..index import StackIndex

BUCKET_TYPES = ("aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2")
SSE_TYPES = (
    "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
    "aws:s3/bucketServerSideEncryptionConfigurationV2:BucketServerSideEncryptionConfigurationV2",
)
VERSIONING_TYPES = ("aws:s3/bucketVersioning:BucketVersioning", "aws:s3/bucketVersioningV2:BucketVersioningV2")
PAB_TYPES = ("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock",)
POLICY_TYPES = ("aws:s3/bucketPolicy:BucketPolicy",)
REPLICATION_TYPES = ("aws:s3/bucketReplicationConfig:BucketReplicationConfig",)
LIFECYCLE_TYPES = (
    "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration",
    "aws:s3/bucketLifecycleConfigurationV2:BucketLifecycleConfigurationV2",
)
ENCRYPTION_ALGORITHMS = ("aws:kms", "aws:kms:dsse", "AES256")
KMS_ALGORITHMS = ("aws:kms", "aws:kms:dsse")
PUBLIC_ACCESS_FLAGS = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")


def _side(index: StackIndex, types: tuple[str, ...], bucket: PolicyResource) -> list[PolicyResource]:
    return [r for r in index.of_type(*types) if index.referenced(r, BUCKET_TYPES, "bucket", ("bucket",)) is bucket]


def _label(bucket: PolicyResource) -> str:
    return f"bucket {bucket.name!r}"


def _sse_algorithms(index: StackIndex, bucket: PolicyResource) -> list[str]:
    found = []
    for sse in _side(index, SSE_TYPES, bucket):
        for rule in iter_mappings(get(sse.props, "rules")):
            found.append(get(rule, "applyServerSideEncryptionByDefault", "sseAlgorithm"))
    inline = get(bucket.props, "serverSideEncryptionConfiguration", "rule", "applyServerSideEncryptionByDefault")
    if inline is not None:
        found.append(get(inline, "sseAlgorithm"))
    return [a for a in found if a is not None]


def _validate_encryption(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for bucket in index.of_type(*BUCKET_TYPES):
        algorithms = _sse_algorithms(index, bucket)
        if not algorithms:
            report(
                f"{_label(bucket)} has no default encryption: add an aws.s3.BucketServerSideEncryptionConfiguration "
                f"(sseAlgorithm aws:kms with the stack's KMS key)",
                bucket.urn,
            )
        for algorithm in algorithms:
            if algorithm not in ENCRYPTION_ALGORITHMS:
                report(
                    f"{_label(bucket)}: sseAlgorithm {algorithm!r} is not one of {', '.join(ENCRYPTION_ALGORITHMS)}",
                    bucket.urn,
                )


def _validate_versioning(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for bucket in index.of_type(*BUCKET_TYPES):
        statuses = [get(v.props, "versioningConfiguration", "status") for v in _side(index, VERSIONING_TYPES, bucket)]
        if as_bool(get(bucket.props, "versioning", "enabled")):
            statuses.append("Enabled")
        if "Enabled" not in statuses:
            shown = ", ".join(repr(s) for s in statuses) if statuses else "no aws.s3.BucketVersioning"
            report(
                f"{_label(bucket)} is not versioned ({shown}): published model packages must survive an overwrite "
                f"or a delete; set versioningConfiguration.status = 'Enabled'",
                bucket.urn,
            )


def _validate_public_access(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for bucket in index.of_type(*BUCKET_TYPES):
        blocks = _side(index, PAB_TYPES, bucket)
        if not blocks:
            report(
                f"{_label(bucket)} has no aws.s3.BucketPublicAccessBlock: set all four of "
                f"{', '.join(PUBLIC_ACCESS_FLAGS)} to true",
                bucket.urn,
            )
            continue
        for block in blocks:
            off = [flag for flag in PUBLIC_ACCESS_FLAGS if as_bool(get(block.props, flag)) is not True]
            if off:
                report(
                    f"{_label(bucket)}: public access block {block.name!r} leaves {', '.join(off)} not true",
                    bucket.urn,
                )


def _is_everyone(principal: Any) -> bool:
    if principal == "*":
        return True
    return isinstance(principal, Mapping) and "*" in as_list(principal.get("AWS"))


def _denies_plain_http(statement: Mapping[str, Any]) -> bool:
    if statement.get("Effect") != "Deny" or not _is_everyone(statement.get("Principal")):
        return False
    if not {"s3:*", "*"} & set(as_list(statement.get("Action"))):
        return False
    secure = get(statement, "Condition", "Bool", "aws:SecureTransport")
    if not any(str(v).lower() == "false" for v in as_list(secure)):
        return False
    resources = [str(r) for r in as_list(statement.get("Resource"))]
    # Both the bucket ARN (ListBucket and friends) and its objects (GetObject): one without the other leaves a gap.
    return any(r.endswith("/*") for r in resources) and any(not r.endswith("/*") for r in resources)


def _policy_documents(index: StackIndex, bucket: PolicyResource) -> list[tuple[str, Any]]:
    docs = [(p.name, get(p.props, "policy")) for p in _side(index, POLICY_TYPES, bucket)]
    if get(bucket.props, "policy") is not None:
        docs.append((bucket.name, get(bucket.props, "policy")))
    return docs


def _validate_tls_only(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for bucket in index.of_type(*BUCKET_TYPES):
        docs = _policy_documents(index, bucket)
        ok = False
        for source, raw in docs:
            try:
                doc = json_document(raw)
            except ValueError as err:
                report(f"{_label(bucket)}: bucket policy {source!r} is not valid JSON: {err}", bucket.urn)
                continue
            ok = ok or any(_denies_plain_http(s) for s in iter_mappings(get(doc, "Statement")))
        if not ok:
            why = "has no bucket policy" if not docs else "has a bucket policy without a TLS-only statement"
            report(
                f"{_label(bucket)} {why}: add a Deny for Principal '*' on s3:* over the bucket and bucket/* ARNs "
                f"with Condition Bool aws:SecureTransport = false",
                bucket.urn,
            )


def _validate_kms(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for bucket in index.of_type(*BUCKET_TYPES):
        algorithms = _sse_algorithms(index, bucket)
        # Only when the encryption itself is valid (s3-bucket-encryption reports the rest).
        if algorithms and set(algorithms) <= set(ENCRYPTION_ALGORITHMS) and not set(algorithms) & set(KMS_ALGORITHMS):
            report(
                f"{_label(bucket)} is encrypted with {', '.join(sorted(set(algorithms)))} only: use aws:kms with a "
                f"customer-managed key so that access to the weights is auditable and revocable in KMS",
                bucket.urn,
            )


def _validate_noncurrent_expiry(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for bucket in index.of_type(*BUCKET_TYPES):
        rules = []
        for lifecycle in _side(index, LIFECYCLE_TYPES, bucket):
            rules.extend(iter_mappings(get(lifecycle.props, "rules")))
        rules.extend(iter_mappings(get(bucket.props, "lifecycleRules")))
        # Side resource rules say status "Enabled"; the deprecated inline rules say enabled: true.
        expires = any(
            (get(r, "status") == "Enabled" or as_bool(get(r, "enabled")) is True)
            and get(r, "noncurrentVersionExpiration") is not None
            for r in rules
        )
        if not expires:
            report(
                f"{_label(bucket)} keeps noncurrent object versions forever: with versioning on, every re-published "
                f"multi-GB weight file stays billed; add a lifecycle rule with noncurrentVersionExpiration",
                bucket.urn,
            )


def _validate_replication(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for bucket in index.of_type(*BUCKET_TYPES):
        if not set(_sse_algorithms(index, bucket)) & set(KMS_ALGORITHMS):
            continue
        for config in _side(index, REPLICATION_TYPES, bucket):
            for rule in iter_mappings(get(config.props, "rules")):
                if get(rule, "status") != "Enabled":
                    continue
                label = f"{_label(bucket)} replication rule {get(rule, 'id') or '?'!r}"
                if get(rule, "sourceSelectionCriteria", "sseKmsEncryptedObjects", "status") != "Enabled":
                    report(f"{label} does not select SSE-KMS objects (sourceSelectionCriteria.sseKmsEncryptedObjects):"
                           f" S3 silently skips every KMS-encrypted object, which here is every model package",
                           bucket.urn)
                if not get(rule, "destination", "encryptionConfiguration", "replicaKmsKeyId"):
                    report(f"{label} names no destination.encryptionConfiguration.replicaKmsKeyId: KMS-encrypted "
                           f"objects cannot be replicated without a key in the destination region", bucket.urn)


s3_encryption = StackValidationPolicy(
    name="s3-bucket-encryption",
    description="Every S3 bucket has default server-side encryption.",
    validate=_validate_encryption,
    enforcement_level=EnforcementLevel.MANDATORY,
)
s3_versioning = StackValidationPolicy(
    name="s3-bucket-versioning",
    description="Every S3 bucket has versioning enabled.",
    validate=_validate_versioning,
    enforcement_level=EnforcementLevel.MANDATORY,
)
s3_public_access_block = StackValidationPolicy(
    name="s3-public-access-block",
    description="Every S3 bucket has a public access block with all four settings on.",
    validate=_validate_public_access,
    enforcement_level=EnforcementLevel.MANDATORY,
)
s3_tls_only = StackValidationPolicy(
    name="s3-tls-only",
    description="Every S3 bucket policy denies requests that do not use TLS (aws:SecureTransport = false).",
    validate=_validate_tls_only,
    enforcement_level=EnforcementLevel.MANDATORY,
)
s3_kms = StackValidationPolicy(
    name="s3-kms-encryption",
    description="S3 buckets are encrypted with KMS rather than S3-managed keys.",
    validate=_validate_kms,
    enforcement_level=EnforcementLevel.ADVISORY,
)
s3_noncurrent_expiry = StackValidationPolicy(
    name="s3-noncurrent-version-expiry",
    description="Versioned buckets expire noncurrent object versions.",
    validate=_validate_noncurrent_expiry,
    enforcement_level=EnforcementLevel.ADVISORY,
)

s3_replication_kms = StackValidationPolicy(
    name="s3-replication-kms-objects",
    description="Replication of a KMS-encrypted bucket selects SSE-KMS objects and re-encrypts them with a "
                "destination key.",
    validate=_validate_replication,
    enforcement_level=EnforcementLevel.MANDATORY,
)

POLICIES = [
    s3_encryption,
    s3_versioning,
    s3_public_access_block,
    s3_tls_only,
    s3_replication_kms,
    s3_kms,
    s3_noncurrent_expiry,
]
