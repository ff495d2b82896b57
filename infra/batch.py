"""The batch path's infrastructure (docs/batch.md): the region's batch bucket and one batch worker per LLM.

- The bucket `<model bucket>-batch` holds client files, batch records, per-line results and the result cache. It
  is the model bucket's equal in protection (KMS with a key of its own, versioning, no public access, TLS only, a
  lifecycle) but it **never replicates**: client data stays in its region, while the model bucket replicates
  everything to the replica regions (infra/storage.py). It is a bucket of its own, not a prefix of the model
  bucket, so no replication rule and no FSx data repository association can ever reach it.
- Each `kind: vllm` model gets a worker Deployment (`python3 -m serving_image.batch.worker`, the serving image),
  one replica (the worker has no lease yet: docs/batch.md, "Not done yet"), on the system nodes, that drives the
  model's own OpenAI route through the Gateway, as any client does, and keeps that model's batches under
  `s3://<batch bucket>/<model id>/`. Its IAM role (IRSA) may read, write, list and delete that prefix only, and use
  the batch key: it cannot read another model's batches, the model bucket, or anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.config import ModelConfig, StackConfig
from infra.gateway_auth import batch_worker_external_secret_spec, batch_worker_key_secret
from infra.iam import irsa_service_account, policy_document
from infra.naming import platform_labels
from infra.secure_bucket import SecureBucketArgs, secure_bucket
from llm_serving import pod_contract as pc

WORKER_MODULE = "serving_image.batch.worker"
BATCH_COMPONENT = "batch-worker"
# Client deletions must really delete: a deleted file's noncurrent version lasts a day, not the model bucket's weeks.
NONCURRENT_DAYS = 1
CONCURRENCY = 8  # the worker's requests in flight; the front-end's admission share bounds it again
METRICS_PORT = 9102  # the worker's own /metrics (prometheus_client): scraped, and what its probes ask
API_KEY_DIR = "/var/run/llm-serving/batch-worker"


def batch_bucket_name(cfg: StackConfig) -> str:
    return f"{cfg.bucket_name()}-batch"


def worker_name(model_id: str) -> str:
    return f"{model_id}-{BATCH_COMPONENT}"


def store_uri(bucket: str, model_id: str) -> str:
    return f"s3://{bucket}/{model_id}"


def worker_policy(bucket_arn: pulumi.Input[str], model_id: str, kms_key_arn: pulumi.Input[str]) -> pulumi.Output[str]:
    """The model's prefix of the batch bucket, read, written, listed and deleted; the batch key; nothing else."""
    bucket = pulumi.Output.from_input(bucket_arn)
    return policy_document(
        {"Sid": "ThisModelsBatches", "Effect": "Allow",
         "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
         "Resource": [bucket.apply(lambda b: f"{b}/{model_id}/*")]},
        {"Sid": "ListThisModelsBatches", "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [bucket],
         "Condition": {"StringLike": {"s3:prefix": [f"{model_id}/*"]}}},
        {"Sid": "UseTheBatchKey", "Effect": "Allow", "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
         "Resource": [kms_key_arn]},
    )


def worker_deployment_spec(cfg: StackConfig, model: ModelConfig, image: str, bucket: str, kms_key_arn: str,
                           endpoint: str) -> dict:
    """One worker for one model: its store prefix, the model's route, hardened as the restricted Pod Security
    profile requires, on the system nodes (it needs no GPU: the model's pods do the work)."""
    name = worker_name(model.id)
    labels = {"app.kubernetes.io/name": name, **platform_labels(BATCH_COMPONENT)}
    env = {pc.ENV_BATCH_KMS_KEY: kms_key_arn, "AWS_REGION": cfg.region, "HOME": "/tmp",
           # The key the worker sends through the Gateway to the model's front-end (both check it), as a file from
           # the worker's own Secret (infra/gateway_auth.py: the `<model>-batch-worker` client's key), required.
           pc.ENV_BATCH_WORKER_API_KEY_FILE: f"{API_KEY_DIR}/api-key"}
    container = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", WORKER_MODULE, "--store", store_uri(bucket, model.id), "--endpoint", endpoint,
                    "--concurrency", str(CONCURRENCY), "--metrics-port", str(METRICS_PORT)],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
        # The worker's metrics server answers while its event loop runs: alive and ready are the same thing here.
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": METRICS_PORT}, "periodSeconds": 30,
                          "failureThreshold": 4},
        "readinessProbe": {"httpGet": {"path": "/metrics", "port": METRICS_PORT}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "runAsUser": pc.RUN_AS_UID,
                            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
        # The image's PROMETHEUS_MULTIPROC_DIR (pod_contract.MULTIPROC_DIR) puts prometheus_client in multiprocess
        # mode: the worker's first metric opens a file there, which on the read-only root failed with ENOENT/EROFS
        # and the worker exited before its /metrics answered (seen in `make rehearse`). The model pods have that
        # directory on their `run` volume; the worker gets a volume of its own there.
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"},
                         {"name": "metrics", "mountPath": pc.MULTIPROC_DIR},
                         {"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True}],
    }
    return {
        "replicas": 1,
        # Never two at once (a rollout of the worker itself): without a lease both would send the same lines.
        "strategy": {"type": "Recreate"},
        "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "serviceAccountName": name,
                "automountServiceAccountToken": False,  # IRSA's token is a projected volume of its own
                "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [container],
                "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
                            {"name": "metrics", "emptyDir": {"sizeLimit": "64Mi"}},
                            {"name": "api-key", "secret": {"secretName": batch_worker_key_secret(model.id),
                                                           "defaultMode": 0o440}}],
            },
        },
    }


@dataclass
class BatchArgs:
    config: StackConfig
    provider: k8s.Provider
    namespace: str
    image_ref: pulumi.Input[str]
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer_url: pulumi.Input[str]
    # The API keys' secret in Secrets Manager and the namespace's SecretStore (infra/gateway_auth.py): each
    # worker's key comes from there.
    api_keys_secret_name: str = ""
    secret_store: pulumi.Resource | None = None
    depends_on: list[pulumi.Resource] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)


class BatchStore(pulumi.ComponentResource):
    """The region's batch bucket and its key; workers are added per model with `add_worker`."""

    bucket_name: pulumi.Output[str]
    bucket_arn: pulumi.Output[str]
    kms_key_arn: pulumi.Output[str]

    def __init__(self, name: str, args: BatchArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("llm-serving:infra:BatchStore", name, None, opts)
        self.args = args
        self.name = name
        child = pulumi.ResourceOptions(parent=self)
        cfg = args.config
        key = aws.kms.Key(f"{name}-key", description=f"batch bucket key ({cfg.region}): client files and results",
                          enable_key_rotation=True, deletion_window_in_days=30, tags=args.tags, opts=child)
        bucket, _ = secure_bucket(
            f"{name}-bucket", SecureBucketArgs(bucket_name=batch_bucket_name(cfg), kms_key=key, tags=args.tags,
                                               lifecycle_rule_id="expire-deleted-client-data",
                                               noncurrent_days=NONCURRENT_DAYS, abort_multipart_days=1), child)
        # Deliberately no aws.s3.BucketReplicationConfig: client data stays in its region.
        self.bucket_name, self.bucket_arn, self.kms_key_arn = bucket.bucket, bucket.arn, key.arn
        self.workers: list[str] = []
        self.register_outputs({"batchBucket": self.bucket_name})

    def serving_env(self, model: ModelConfig) -> dict[str, pulumi.Input[str]]:
        """What the model's own pods need to serve the Files and Batches API on its prefix (serving_image/batch/
        config.py): the store, and the key its objects are written with (the bucket's own)."""
        return {pc.ENV_BATCH_STORE: store_uri(batch_bucket_name(self.args.config), model.id),
                pc.ENV_BATCH_KMS_KEY: self.kms_key_arn}

    def grant_serving(self, serving_role_arn: pulumi.Input[str], models: list[ModelConfig]) -> None:
        """The model servers' role (one for every model, infra/serving_platform.py) may use the LLMs' prefixes of
        the batch bucket: the front-end writes the uploads and batch records there and reads the results back."""
        if not models:
            return
        bucket = self.bucket_arn
        role_name = pulumi.Output.from_input(serving_role_arn).apply(lambda arn: arn.rsplit("/", 1)[-1])
        aws.iam.RolePolicy(f"{self.name}-serving", role=role_name, policy=policy_document(
            {"Sid": "ServeTheLLMsBatches", "Effect": "Allow",
             "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
             "Resource": [bucket.apply(lambda b, m=m: f"{b}/{m.id}/*") for m in models]},
            {"Sid": "ListTheLLMsBatches", "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [bucket],
             "Condition": {"StringLike": {"s3:prefix": [f"{m.id}/*" for m in models]}}},
            {"Sid": "UseTheBatchKey", "Effect": "Allow", "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
             "Resource": [self.kms_key_arn]}), opts=pulumi.ResourceOptions(parent=self))

    def add_worker(self, model: ModelConfig, openai_endpoint: str) -> None:
        """The model's worker: `openai_endpoint` is its route's OpenAI base URL (`https://<host>/v1`)."""
        args, cfg = self.args, self.args.config
        name = worker_name(model.id)
        prefix = f"{self.name}-{model.id}"
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=args.depends_on)
        meta = {"name": name, "namespace": args.namespace, "labels": platform_labels(BATCH_COMPONENT)}
        _, sa = irsa_service_account(
            f"{prefix}-role", f"{prefix}-sa", namespace=args.namespace, service_account=name, labels=meta["labels"],
            oidc_provider_arn=args.oidc_provider_arn, oidc_issuer_url=args.oidc_issuer_url,
            policy=worker_policy(self.bucket_arn, model.id, self.kms_key_arn), tags=args.tags,
            role_opts=pulumi.ResourceOptions(parent=self), account_opts=k8s_opts)
        # Ingress to the metrics port from the monitoring namespace only; egress to DNS and HTTPS only (S3, STS,
        # the model's route through the Gateway).
        k8s.networking.v1.NetworkPolicy(
            f"{prefix}-netpol", metadata=meta,
            spec={"podSelector": {"matchLabels": {"app.kubernetes.io/name": name}},
                  "policyTypes": ["Ingress", "Egress"],
                  "ingress": [{"ports": [{"protocol": "TCP", "port": METRICS_PORT}],
                               "from": [{"namespaceSelector": {"matchLabels": {
                                   "kubernetes.io/metadata.name": cfg.serving.monitoring_namespace}}}]}],
                  "egress": [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
                             {"ports": [{"protocol": "TCP", "port": 443}]}]},
            opts=k8s_opts)
        # The worker's key: its client's entry of the API keys' secret, synced into its own Secret (required).
        if not args.api_keys_secret_name or args.secret_store is None:
            raise ValueError(f"batch worker {name}: no API keys' secret to take its key from (BatchArgs."
                             "api_keys_secret_name, secret_store)")
        key = k8s.apiextensions.CustomResource(
            f"{prefix}-api-key", api_version="external-secrets.io/v1", kind="ExternalSecret",
            metadata={**meta, "name": batch_worker_key_secret(model.id),
                      "annotations": {"pulumi.com/waitFor": "condition=Ready", "pulumi.com/timeoutSeconds": "900"}},
            spec=batch_worker_external_secret_spec(args.api_keys_secret_name, model.id),
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider,
                                        depends_on=[*args.depends_on, args.secret_store]))
        endpoint = openai_endpoint.removesuffix("/v1")
        spec = pulumi.Output.all(args.image_ref, self.bucket_name, self.kms_key_arn).apply(
            lambda v: worker_deployment_spec(cfg, model, v[0], v[1], v[2], endpoint))
        k8s.apps.v1.Deployment(
            f"{prefix}-deployment", metadata=meta, spec=spec,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[*args.depends_on, sa, key]))
        self.workers.append(name)
