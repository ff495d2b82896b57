"""The region's model-cache warmer: a CronJob on the file system the model pods mount (docs/first-update.md, "A warm
model cache").

FSx's data repository association imports metadata only; the warmer (serving_image/cache_warmer.py, run from the
serving image) restores and verifies every file of every package requested for this region, and writes the
region's resident marker in S3 (llm_serving.cache_state), which `llm-serving rollout start` requires. Its IAM role
reads the model prefix and the warm requests, and writes markers of its own region only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from infra.config import StackConfig
from infra.iam import irsa_service_account, policy_document
from infra.naming import platform_labels
from llm_serving import cache_state
from llm_serving import pod_contract as pc

WARMER_NAME = "model-cache-warmer"
# Often enough that a publish waits minutes, not hours, for the warmer to start; a run that is still restoring a
# large package keeps the next one from starting (concurrencyPolicy Forbid).
SCHEDULE = "*/5 * * * *"
# A whole large package's first load from S3: FSx streams it at the file system's throughput; days would mean a
# stuck run, which the next schedule retries.
ACTIVE_DEADLINE_SECONDS = 12 * 3600
WARMER_MODULE = "serving_image.cache_warmer"


@dataclass
class CacheWarmerArgs:
    config: StackConfig
    provider: k8s.Provider
    namespace: str
    model_cache_claim: str
    image_ref: pulumi.Input[str]
    bucket_arn: pulumi.Input[str]
    bucket_name: pulumi.Input[str]
    kms_key_arn: pulumi.Input[str]
    file_system_id: pulumi.Input[str]
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer_url: pulumi.Input[str]
    depends_on: list[pulumi.Resource] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)


def warmer_policy(bucket_arn: pulumi.Input[str], model_prefix: str, region: str,
                  kms_key_arn: pulumi.Input[str]) -> pulumi.Output[str]:
    """Read the packages and the warm requests; write this region's resident markers and nothing else."""
    bucket = pulumi.Output.from_input(bucket_arn)
    requests = f"{cache_state.CACHE_STATE_PREFIX}/requests/"
    markers = f"{cache_state.CACHE_STATE_PREFIX}/resident/{region}/"
    return policy_document(
        {"Sid": "ReadPackagesAndRequests", "Effect": "Allow", "Action": ["s3:GetObject"],
         "Resource": [bucket.apply(lambda b: f"{b}/{model_prefix}*"), bucket.apply(lambda b: f"{b}/{requests}*"),
                      bucket.apply(lambda b: f"{b}/{markers}*")]},
        {"Sid": "ListPackagesAndRequests", "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [bucket],
         "Condition": {"StringLike": {"s3:prefix": [f"{model_prefix}*", f"{requests}*", f"{markers}*"]}}},
        {"Sid": "WriteThisRegionsMarkers", "Effect": "Allow", "Action": ["s3:PutObject"],
         "Resource": [bucket.apply(lambda b: f"{b}/{markers}*")]},
        {"Sid": "UseTheBucketKey", "Effect": "Allow", "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
         "Resource": [kms_key_arn]},
    )


def cronjob_spec(cfg: StackConfig, image: str, bucket: str, file_system_id: str, claim: str) -> dict:
    """The CronJob's spec: the serving image's warmer module on the model cache (read-only: reading a file is what
    loads it), on the untainted system nodes, hardened as the namespace's restricted Pod Security requires."""
    env = {
        pc.ENV_CACHE_BUCKET: bucket,
        pc.ENV_CACHE_REGION: cfg.region,
        pc.ENV_CACHE_MODEL_PREFIX: cfg.model_storage.model_prefix,
        pc.ENV_CACHE_FILE_SYSTEM_ID: file_system_id,
        "HOME": "/tmp",
    }
    labels = {"app.kubernetes.io/name": WARMER_NAME, **platform_labels("model-cache-warmer")}
    container = {
        "name": "warmer",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", WARMER_MODULE],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        # A CPU limit here (unlike the model servers): a batch reader that must not take the system nodes' cores.
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "runAsUser": pc.RUN_AS_UID,
                            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumeMounts": [{"name": pc.MODEL_CACHE_VOLUME, "mountPath": pc.MODEL_CACHE_MOUNT, "readOnly": True},
                         {"name": "scratch", "mountPath": "/tmp"}],
    }
    return {
        "schedule": SCHEDULE,
        "concurrencyPolicy": "Forbid",
        "successfulJobsHistoryLimit": 3,
        "failedJobsHistoryLimit": 5,
        "jobTemplate": {"spec": {
            "backoffLimit": 2,
            "activeDeadlineSeconds": ACTIVE_DEADLINE_SECONDS,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": WARMER_NAME,
                    # IRSA's web identity token is a projected volume of its own; no Kubernetes API token needed.
                    "automountServiceAccountToken": False,
                    "restartPolicy": "Never",
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [
                        {"name": pc.MODEL_CACHE_VOLUME,
                         "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},
                        {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
                    ],
                },
            },
        }},
    }


class CacheWarmer(pulumi.ComponentResource):
    cronjob_name: str

    def __init__(self, name: str, args: CacheWarmerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("llm-serving:infra:CacheWarmer", name, None, opts)
        cfg = args.config
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=args.depends_on)
        meta = {"name": WARMER_NAME, "namespace": args.namespace, "labels": platform_labels("model-cache-warmer")}
        role, sa = irsa_service_account(
            f"{name}-role", f"{name}-sa", namespace=args.namespace, service_account=WARMER_NAME,
            labels=meta["labels"], oidc_provider_arn=args.oidc_provider_arn, oidc_issuer_url=args.oidc_issuer_url,
            policy=warmer_policy(args.bucket_arn, cfg.model_storage.model_prefix, cfg.region, args.kms_key_arn),
            tags=args.tags, role_opts=pulumi.ResourceOptions(parent=self), account_opts=k8s_opts)
        # No ingress at all; egress to DNS and HTTPS (S3) only.
        k8s.networking.v1.NetworkPolicy(
            f"{name}-netpol", metadata=meta,
            spec={"podSelector": {"matchLabels": {"app.kubernetes.io/name": WARMER_NAME}},
                  "policyTypes": ["Ingress", "Egress"], "ingress": [],
                  "egress": [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
                             {"ports": [{"protocol": "TCP", "port": 443}]}]},
            opts=k8s_opts)
        spec = pulumi.Output.all(args.image_ref, args.bucket_name, args.file_system_id).apply(
            lambda v: cronjob_spec(cfg, v[0], v[1], v[2], args.model_cache_claim))
        cronjob = k8s.batch.v1.CronJob(
            f"{name}-cronjob", metadata=meta, spec=spec,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[*args.depends_on, sa]))
        self.cronjob_name = WARMER_NAME
        self.register_outputs({"cronJob": cronjob.metadata["name"], "roleArn": role.arn})
