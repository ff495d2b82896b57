"""A private, KMS-encrypted, versioned S3 bucket: what the model bucket (storage.py) and the batch bucket (batch.py)
both are. One place holds the controls every bucket of the platform carries, so a new bucket cannot miss one:
versioning, SSE-KMS with the bucket key, every public access blocked, TLS only, old versions expired."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.iam import policy_document


@dataclass(frozen=True)
class SecureBucketArgs:
    bucket_name: str
    kms_key: aws.kms.Key
    tags: dict[str, str]
    lifecycle_rule_id: str  # names the rule that expires noncurrent versions
    noncurrent_days: int  # how long an overwritten or deleted object's old version is kept
    abort_multipart_days: int


def secure_bucket(resource_name: str, args: SecureBucketArgs,
                  opts: pulumi.ResourceOptions) -> tuple[aws.s3.Bucket, aws.s3.BucketVersioning]:
    """The bucket (under `opts`) and its controls (its children); returns the bucket and its versioning, which a
    replication configuration must depend on."""
    bucket = aws.s3.Bucket(resource_name, bucket=args.bucket_name, force_destroy=False, tags=args.tags, opts=opts)
    bucket_child = pulumi.ResourceOptions(parent=bucket)
    versioning = aws.s3.BucketVersioning(resource_name, bucket=bucket.id,
                                         versioning_configuration={"status": "Enabled"}, opts=bucket_child)
    aws.s3.BucketServerSideEncryptionConfiguration(
        resource_name, bucket=bucket.id,
        rules=[{"apply_server_side_encryption_by_default": {"sse_algorithm": "aws:kms",
                                                            "kms_master_key_id": args.kms_key.arn},
                "bucket_key_enabled": True}],
        opts=bucket_child)
    public_block = aws.s3.BucketPublicAccessBlock(
        resource_name, bucket=bucket.id, block_public_acls=True, block_public_policy=True,
        ignore_public_acls=True, restrict_public_buckets=True, opts=bucket_child)
    aws.s3.BucketPolicy(
        resource_name, bucket=bucket.id,
        policy=policy_document({
            "Sid": "DenyInsecureTransport", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
            "Resource": [bucket.arn, bucket.arn.apply(lambda a: f"{a}/*")],
            "Condition": {"Bool": {"aws:SecureTransport": "false"}},
        }),
        opts=pulumi.ResourceOptions(parent=bucket, depends_on=[public_block]))
    aws.s3.BucketLifecycleConfiguration(
        resource_name, bucket=bucket.id,
        rules=[{
            "id": args.lifecycle_rule_id, "status": "Enabled", "filter": {"prefix": ""},
            "noncurrent_version_expiration": {"noncurrent_days": args.noncurrent_days},
            "abort_incomplete_multipart_upload": {"days_after_initiation": args.abort_multipart_days},
        }],
        opts=pulumi.ResourceOptions(parent=bucket, depends_on=[versioning]))
    return bucket, versioning
