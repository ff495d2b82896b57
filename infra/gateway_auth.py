"""Caller authentication (docs/architecture.md §3.12): who may call a model, checked twice.

- **At the Gateway.** One Envoy Gateway SecurityPolicy on the platform's Gateway (so on every route it carries, a
  route added later included) with `apiKeyAuth`: a request without `Authorization: Bearer <key>` (HTTP header or gRPC
  metadata), or with a key that is not one of the clients', is answered 401 by Envoy and reaches no pod. The key
  stays on the request (`sanitize: false`): the pod checks it again.
- **At the pod.** Every model pod mounts the same keys read-only (pod_contract.API_KEYS_MOUNT) and sets
  pod_contract.ENV_REQUIRE_API_KEYS: the server refuses to start without a key and checks it on OpenAI 9000, KServe
  HTTP 8000 and KServe gRPC 8001 (infra/serving.py renders it; policy `serving-api-keys-required` holds every model
  Deployment to it). With the NetworkPolicy that admits only the Gateway's proxies (infra/serving.py), a caller
  inside the cluster meets both walls.

The keys live in AWS Secrets Manager, never in a stack file or the Pulumi state: the program creates the secret (its
own KMS key) and nothing else writes its value; an operator puts a JSON object `{"<client id>": "<key>", ...}` there
(docs/platform-engineers.md, "API keys"). External Secrets (its Helm chart, pinned in infra/charts.py) syncs it into
the serving namespace's Secret pod_contract.API_KEYS_SECRET, one data entry per client, which is the shape both
Envoy Gateway's `credentialRefs` and the pods' volume read. The SecretStore authenticates with IRSA as a service
account that may read this one secret only. Each LLM's batch worker presents its own entry, `<model>-batch-worker`
(infra/batch.py), through a Secret of its own.
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.bootstrap import release_args
from infra.config import StackConfig
from infra.iam import irsa_service_account, policy_document
from infra.naming import platform_labels
from llm_serving import pod_contract as pc

EXTERNAL_SECRETS_NAMESPACE = "external-secrets"
SECRET_STORE = "aws-secrets-manager"  # the serving namespace's SecretStore
READER_SERVICE_ACCOUNT = "api-keys-reader"  # the SecretStore's IRSA identity: reads the API key secret only
SECURITY_POLICY = "llm-serving-api-keys"
REFRESH_INTERVAL = "5m"  # a key added to (or removed from) Secrets Manager reaches the Gateway and the pods within it
# Pulumi waits until the ExternalSecret has synced (its Secret exists) before the pods that mount it start.
EXTERNAL_SECRET_AWAIT = {"pulumi.com/waitFor": "condition=Ready", "pulumi.com/timeoutSeconds": "900"}


def api_keys_secret_name(cfg: StackConfig) -> str:
    """The Secrets Manager secret of a stack's client keys."""
    return f"llm-serving/{cfg.environment}/{cfg.region}/api-keys"


def batch_worker_client(model_id: str) -> str:
    """The client id (the secret's JSON property) whose key a model's batch worker presents."""
    return f"{model_id}-batch-worker"


def batch_worker_key_secret(model_id: str) -> str:
    """The Kubernetes Secret holding a batch worker's key (data entry `api-key`)."""
    return f"{batch_worker_client(model_id)}-api-key"


def security_policy_spec(gateway_name: str) -> dict:
    """API keys on every route of the Gateway: 401 without one of the Secret's keys."""
    return {
        "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway_name}],
        "apiKeyAuth": {
            "credentialRefs": [{"group": "", "kind": "Secret", "name": pc.API_KEYS_SECRET}],
            # Envoy strips "Bearer " from the header's value; gRPC metadata is an HTTP/2 header.
            "extractFrom": [{"headers": [pc.AUTHORIZATION_HEADER]}],
            "sanitize": False,  # the pod checks the same key again
        },
    }


def secret_store_spec(region: str) -> dict:
    return {"provider": {"aws": {"service": "SecretsManager", "region": region,
                                 "auth": {"jwt": {"serviceAccountRef": {"name": READER_SERVICE_ACCOUNT}}}}}}


def api_keys_external_secret_spec(secret_name: str) -> dict:
    """Every property of the secret's JSON object becomes a data entry of pc.API_KEYS_SECRET (client id -> key)."""
    return {"refreshInterval": REFRESH_INTERVAL,
            "secretStoreRef": {"kind": "SecretStore", "name": SECRET_STORE},
            "target": {"name": pc.API_KEYS_SECRET, "creationPolicy": "Owner"},
            "dataFrom": [{"extract": {"key": secret_name}}]}


def batch_worker_external_secret_spec(secret_name: str, model_id: str) -> dict:
    """The batch worker's one key, the secret's `<model>-batch-worker` property, as data entry `api-key`."""
    return {"refreshInterval": REFRESH_INTERVAL,
            "secretStoreRef": {"kind": "SecretStore", "name": SECRET_STORE},
            "target": {"name": batch_worker_key_secret(model_id), "creationPolicy": "Owner"},
            "data": [{"secretKey": "api-key",
                      "remoteRef": {"key": secret_name, "property": batch_worker_client(model_id)}}]}


def reader_policy(secret_arn: pulumi.Input[str], kms_key_arn: pulumi.Input[str]) -> pulumi.Output[str]:
    return policy_document(
        {"Sid": "ReadTheApiKeys", "Effect": "Allow",
         "Action": ["secretsmanager:GetSecretValue", "secretsmanager:DescribeSecret"], "Resource": [secret_arn]},
        {"Sid": "DecryptTheApiKeys", "Effect": "Allow", "Action": ["kms:Decrypt"], "Resource": [kms_key_arn]},
    )


class GatewayAuth(pulumi.ComponentResource):
    """The secret, External Secrets, the serving namespace's SecretStore and ExternalSecret, the SecurityPolicy.
    `ready`: what a model Deployment waits for (the keys' Secret synced); `store`: what another ExternalSecret of
    the namespace (a batch worker's) waits for."""

    secret_name: str
    ready: list[pulumi.Resource]
    store: pulumi.Resource

    def __init__(self, name: str, *, config: StackConfig, provider: k8s.Provider, namespace: str, gateway_name: str,
                 namespace_resource: pulumi.Resource, gateway: pulumi.Resource,
                 oidc_provider_arn: pulumi.Input[str], oidc_issuer_url: pulumi.Input[str], tags: dict[str, str],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("llm-serving:infra:GatewayAuth", name, None, opts)
        labels = platform_labels("gateway-auth")
        aws_opts = pulumi.ResourceOptions(parent=self)
        self.secret_name = api_keys_secret_name(config)
        key = aws.kms.Key(f"{name}-key", description=f"API keys of the serving platform ({config.region})",
                          enable_key_rotation=True, deletion_window_in_days=30, tags=tags, opts=aws_opts)
        # No SecretVersion: the value is the operators' (docs/platform-engineers.md, "API keys"), never the state's.
        secret = aws.secretsmanager.Secret(
            f"{name}-secret", name=self.secret_name, kms_key_id=key.arn, recovery_window_in_days=30,
            description="Client API keys of the model gateway: a JSON object, client id -> key", tags=tags,
            opts=aws_opts)

        eso_ns = k8s.core.v1.Namespace(f"{name}-external-secrets-ns",
                                       metadata={"name": EXTERNAL_SECRETS_NAMESPACE, "labels": labels},
                                       opts=pulumi.ResourceOptions(parent=self, provider=provider))
        external_secrets = k8s.helm.v3.Release(
            f"{name}-external-secrets", name="external-secrets", namespace=EXTERNAL_SECRETS_NAMESPACE,
            values={"installCRDs": True}, atomic=True, timeout=900, **release_args("external-secrets"),
            opts=pulumi.ResourceOptions(parent=self, provider=provider, depends_on=[eso_ns]))
        ns_opts = pulumi.ResourceOptions(parent=self, provider=provider, depends_on=[namespace_resource])
        _, reader = irsa_service_account(
            f"{name}-reader", f"{name}-reader", namespace=namespace, service_account=READER_SERVICE_ACCOUNT,
            labels=labels, oidc_provider_arn=oidc_provider_arn, oidc_issuer_url=oidc_issuer_url,
            policy=reader_policy(secret.arn, key.arn), tags=tags, role_opts=aws_opts, account_opts=ns_opts)
        self.store = k8s.apiextensions.CustomResource(
            f"{name}-secret-store", api_version="external-secrets.io/v1", kind="SecretStore",
            metadata={"name": SECRET_STORE, "namespace": namespace, "labels": labels},
            spec=secret_store_spec(config.region),
            opts=pulumi.ResourceOptions(parent=self, provider=provider,
                                        depends_on=[namespace_resource, external_secrets, reader]))
        keys = k8s.apiextensions.CustomResource(
            f"{name}-external-secret", api_version="external-secrets.io/v1", kind="ExternalSecret",
            metadata={"name": pc.API_KEYS_SECRET, "namespace": namespace, "labels": labels,
                      "annotations": dict(EXTERNAL_SECRET_AWAIT)},
            spec=api_keys_external_secret_spec(self.secret_name),
            opts=pulumi.ResourceOptions(parent=self, provider=provider,
                                        depends_on=[self.store, external_secrets, secret]))
        policy = k8s.apiextensions.CustomResource(
            f"{name}-security-policy", api_version="gateway.envoyproxy.io/v1alpha1", kind="SecurityPolicy",
            metadata={"name": SECURITY_POLICY, "namespace": namespace, "labels": labels},
            spec=security_policy_spec(gateway_name),
            opts=pulumi.ResourceOptions(parent=self, provider=provider, depends_on=[gateway, keys]))
        self.external_secrets = external_secrets
        self.ready = [keys, policy]
        self.register_outputs({"apiKeysSecret": self.secret_name})
