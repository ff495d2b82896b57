"""Model storage: the S3 model bucket (KMS, versioning, no public access, TLS only, lifecycle, replication from the
home region) and FSx for Lustre `PERSISTENT_2` linked to it by a data repository association
(docs/architecture.md §3.4)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.config import StackConfig
from infra.iam import policy_document, role_with_policy, service_trust
from infra.secure_bucket import SecureBucketArgs, secure_bucket
from llm_serving.pod_contract import FSX_MODELS_PATH

LUSTRE_PORTS = ((988, 988), (1018, 1023))
# The service-linked role FSx creates per file system to read and write its linked bucket (one per file system).
FSX_S3_ROLE_PATH = "aws-service-role/s3.data-source.lustre.fsx.amazonaws.com"
FSX_S3_ROLE_PREFIX = "AWSServiceRoleForFSxS3Access_"
FSX_S3_KMS_ACTIONS = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey"]
# Where the data repository association exposes the bucket's model prefix on Lustre: the pod contract's, because
# the pods find their packages below it (llm_serving.pod_contract.package_path_in_pod).
FSX_MOUNT_PATH = FSX_MODELS_PATH


@dataclass(frozen=True)
class ModelStorageArgs:
    config: StackConfig
    vpc_id: pulumi.Input[str]
    fsx_subnet_id: pulumi.Input[str]
    node_security_group_id: pulumi.Input[str]
    tags: dict[str, str] = field(default_factory=dict)


def kms_alias(cfg: StackConfig) -> str:
    """The same alias in every region, so the home region can name each replica bucket's key without reading it."""
    return f"alias/{cfg.model_storage.bucket_prefix}-{cfg.environment}-models"


class ModelStorage(pulumi.ComponentResource):
    bucket_name: pulumi.Output[str]
    bucket_arn: pulumi.Output[str]
    kms_key_arn: pulumi.Output[str]
    file_system_id: pulumi.Output[str]
    file_system_dns_name: pulumi.Output[str]
    file_system_mount_name: pulumi.Output[str]

    def __init__(self, name: str, args: ModelStorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("llm-serving:infra:ModelStorage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        cfg, storage = args.config, args.config.model_storage

        key = aws.kms.Key(f"{name}-models", description=f"model bucket and model cache key ({cfg.region})",
                          enable_key_rotation=True, deletion_window_in_days=30, tags=args.tags, opts=child)
        aws.kms.Alias(f"{name}-models", name=kms_alias(cfg), target_key_id=key.key_id, opts=child)
        bucket, versioning = secure_bucket(
            f"{name}-models", SecureBucketArgs(bucket_name=cfg.bucket_name(), kms_key=key, tags=args.tags,
                                               lifecycle_rule_id="expire-old-versions",
                                               noncurrent_days=storage.noncurrent_version_days,
                                               abort_multipart_days=7), child)
        if storage.replica_regions:
            self._replication(name, args, bucket, key, versioning)

        self.bucket_name, self.bucket_arn, self.kms_key_arn = bucket.bucket, bucket.arn, key.arn
        self._file_system(name, args, bucket, key)
        self.register_outputs({"bucketName": self.bucket_name, "fileSystemId": self.file_system_id})

    def _replication(self, name: str, args: ModelStorageArgs, bucket: aws.s3.Bucket, key: aws.kms.Key,
                     versioning: aws.s3.BucketVersioning) -> None:
        """The home region replicates every object to the same-named bucket of each other region (§3.4: a package
        published once is in every region's bucket before a rollout there names it)."""
        cfg = args.config
        child = pulumi.ResourceOptions(parent=self)
        replicas = cfg.model_storage.replica_regions
        dest_buckets = [f"arn:aws:s3:::{cfg.bucket_name(r.region)}" for r in replicas]
        policy = policy_document(
            {"Sid": "ReadSource", "Effect": "Allow",
             "Action": ["s3:GetReplicationConfiguration", "s3:ListBucket"], "Resource": [bucket.arn]},
            {"Sid": "ReadSourceObjects", "Effect": "Allow",
             "Action": ["s3:GetObjectVersionForReplication", "s3:GetObjectVersionAcl",
                        "s3:GetObjectVersionTagging"],
             "Resource": [bucket.arn.apply(lambda a: f"{a}/*")]},
            {"Sid": "WriteReplicas", "Effect": "Allow",
             "Action": ["s3:ReplicateObject", "s3:ReplicateDelete", "s3:ReplicateTags"],
             "Resource": [f"{b}/*" for b in dest_buckets]},
            {"Sid": "DecryptSource", "Effect": "Allow", "Action": ["kms:Decrypt"], "Resource": [key.arn]},
            {"Sid": "EncryptReplicas", "Effect": "Allow", "Action": ["kms:Encrypt", "kms:GenerateDataKey"],
             "Resource": [r.kms_key_arn for r in replicas]},
        )
        role = role_with_policy(f"{name}-replication", service_trust("s3.amazonaws.com"), policy, (), args.tags,
                                child)
        aws.s3.BucketReplicationConfig(
            f"{name}-models",
            bucket=bucket.id,
            role=role.arn,
            rules=[{
                "id": f"to-{replica.region}", "status": "Enabled", "priority": i, "filter": {"prefix": ""},
                "delete_marker_replication": {"status": "Enabled"},
                "source_selection_criteria": {"sse_kms_encrypted_objects": {"status": "Enabled"}},
                "destination": {
                    "bucket": dest,
                    "storage_class": "STANDARD",
                    "encryption_configuration": {"replica_kms_key_id": replica.kms_key_arn},
                },
            } for i, (replica, dest) in enumerate(zip(replicas, dest_buckets, strict=True))],
            opts=pulumi.ResourceOptions(parent=bucket, depends_on=[versioning]),
        )

    def _file_system(self, name: str, args: ModelStorageArgs, bucket: aws.s3.Bucket, key: aws.kms.Key) -> None:
        cfg, fsx = args.config, args.config.model_storage.fsx
        child = pulumi.ResourceOptions(parent=self)
        sg = aws.ec2.SecurityGroup(f"{name}-lustre", vpc_id=args.vpc_id,
                                   description="FSx for Lustre: Lustre ports from the EKS nodes only",
                                   tags={**args.tags, "Name": f"{name}-lustre"}, opts=child)
        sg_child = pulumi.ResourceOptions(parent=sg)
        for low, high in LUSTRE_PORTS:
            # From the nodes (clients) and from the file system's own servers (Lustre talks server to server).
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-lustre-nodes-{low}", security_group_id=sg.id, ip_protocol="tcp", from_port=low,
                to_port=high, referenced_security_group_id=args.node_security_group_id,
                description=f"Lustre {low}-{high} from EKS nodes", opts=sg_child)
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-lustre-self-{low}", security_group_id=sg.id, ip_protocol="tcp", from_port=low,
                to_port=high, referenced_security_group_id=sg.id,
                description=f"Lustre {low}-{high} between file servers", opts=sg_child)
            aws.vpc.SecurityGroupEgressRule(
                f"{name}-lustre-out-{low}", security_group_id=sg.id, ip_protocol="tcp", from_port=low, to_port=high,
                referenced_security_group_id=sg.id, description=f"Lustre {low}-{high} between file servers",
                opts=sg_child)
        fs = aws.fsx.LustreFileSystem(
            f"{name}-cache",
            deployment_type="PERSISTENT_2",
            storage_capacity=fsx.storage_capacity_gib,
            per_unit_storage_throughput=fsx.per_unit_storage_throughput,
            subnet_ids=args.fsx_subnet_id,
            security_group_ids=[sg.id],
            kms_key_id=key.arn,
            file_system_type_version="2.15",
            data_compression_type="LZ4",
            tags={**args.tags, "Name": f"{name}-cache"},
            opts=pulumi.ResourceOptions(parent=self, custom_timeouts=pulumi.CustomTimeouts(create="60m",
                                                                                           update="60m")),
        )
        key_policy = self._key_policy(name, args, bucket, key, fs)
        prefix = cfg.model_storage.model_prefix
        aws.fsx.DataRepositoryAssociation(
            f"{name}-models",
            file_system_id=fs.id,
            data_repository_path=bucket.bucket.apply(lambda b: f"s3://{b}/{prefix}"),
            file_system_path=FSX_MOUNT_PATH,
            batch_import_meta_data_on_create=True,
            # New and changed packages appear on the cache on their own; nothing on Lustre is written back.
            s3={"auto_import_policy": {"events": ["NEW", "CHANGED", "DELETED"]}},
            tags=args.tags,
            # Lazy loads decrypt through S3 with the bucket's key: the key policy must let FSx's role do so first.
            opts=pulumi.ResourceOptions(parent=fs, depends_on=[key_policy]),
        )
        self.file_system_id, self.file_system_dns_name, self.file_system_mount_name = fs.id, fs.dns_name, fs.mount_name

    def _key_policy(self, name: str, args: ModelStorageArgs, bucket: aws.s3.Bucket, key: aws.kms.Key,
                    fs: aws.fsx.LustreFileSystem) -> aws.kms.KeyPolicy:
        """The bucket key's policy: the account administers it (and so IAM policies grant its use: the model
        servers, S3 replication, ECR), and FSx's S3-access role of *this* file system may use it only through S3
        in this region, only for objects of this bucket (docs/first-update.md, "FSx and KMS").

        A separate KeyPolicy resource because the role's name carries the file system's id, and the file system
        is encrypted with this key: the key exists first, the file system second, then this policy, then the data
        repository association. With S3 Bucket Keys on, S3 asks KMS with the bucket's ARN as encryption context
        (not the object's), so the condition names the bucket ARN exactly."""
        cfg = args.config
        account = aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(parent=self)).account_id
        fsx_role = pulumi.Output.all(account, fs.id).apply(
            lambda a: f"arn:aws:iam::{a[0]}:role/{FSX_S3_ROLE_PATH}/{FSX_S3_ROLE_PREFIX}{a[1]}")
        return aws.kms.KeyPolicy(
            f"{name}-models",
            key_id=key.key_id,
            policy=policy_document(
                {"Sid": "AccountAdministersKey", "Effect": "Allow",
                 "Principal": {"AWS": account.apply(lambda a: f"arn:aws:iam::{a}:root")},
                 "Action": "kms:*", "Resource": "*"},
                {"Sid": "FsxS3AccessThroughS3ForThisBucket", "Effect": "Allow",
                 "Principal": {"AWS": fsx_role}, "Action": FSX_S3_KMS_ACTIONS, "Resource": "*",
                 "Condition": {
                     "StringEquals": {"kms:CallerAccount": account, "kms:ViaService": f"s3.{cfg.region}.amazonaws.com",
                                      "kms:EncryptionContext:aws:s3:arn": bucket.arn}}},
            ),
            opts=pulumi.ResourceOptions(parent=key),
        )
