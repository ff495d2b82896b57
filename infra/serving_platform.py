"""What every model on a cluster shares: the namespace, the model-server service account (IRSA, read-only on the
model prefix), the model cache's PersistentVolume/Claim, the Gateway, KEDA and, where the AMI lacks it, NVIDIA's
device plugin."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from infra.config import StackConfig
from infra.gateway_auth import GatewayAuth
from infra.iam import irsa_service_account, policy_document
from infra.naming import platform_labels
from llm_serving import pod_contract as pc

SERVICE_ACCOUNT = "model-server"
MODEL_CACHE_PVC = "model-cache"
GATEWAY_NAME = "llm-serving"
TLS_SECRET = "llm-serving-tls"
GATEWAY_SERVICE_ANNOTATIONS = {  # (in-tree service controller annotations)
    "service.beta.kubernetes.io/aws-load-balancer-type": "nlb",
    "service.beta.kubernetes.io/aws-load-balancer-internal": "true",
}
DEVICE_PLUGIN_IMAGE = "nvcr.io/nvidia/k8s-device-plugin:v0.17.2"
KEDA_CHART_VERSION = "2.17.2"
KEDA_NAMESPACE = "keda"


@dataclass(frozen=True)
class PlatformArgs:
    config: StackConfig
    provider: k8s.Provider
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer_url: pulumi.Input[str]
    bucket_arn: pulumi.Input[str]
    kms_key_arn: pulumi.Input[str]
    file_system_id: pulumi.Input[str]
    file_system_dns_name: pulumi.Input[str]
    file_system_mount_name: pulumi.Input[str]
    fsx_csi_addon: pulumi.Resource
    # From infra/bootstrap.py: the Gateway waits for its class (and so the CRDs and controller), the Certificate
    # for cert-manager's issuer.
    gateway_class: pulumi.Resource | None = None
    cluster_issuer: pulumi.Resource | None = None
    cluster_issuer_name: str = "llm-serving-acme"
    tags: dict[str, str] = field(default_factory=dict)


def serving_read_policy(bucket_arn: pulumi.Input[str], model_prefix: str,
                        kms_key_arn: pulumi.Input[str]) -> pulumi.Output[str]:
    """Read-only, and only under the model prefix (the packages); the key only to decrypt them."""
    bucket = pulumi.Output.from_input(bucket_arn)
    return policy_document(
        {"Sid": "ReadModelPackages", "Effect": "Allow", "Action": ["s3:GetObject", "s3:GetObjectVersion"],
         "Resource": [bucket.apply(lambda b: f"{b}/{model_prefix}*")]},
        {"Sid": "ListModelPrefix", "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [bucket],
         "Condition": {"StringLike": {"s3:prefix": [f"{model_prefix}*"]}}},
        {"Sid": "DecryptModelPackages", "Effect": "Allow", "Action": ["kms:Decrypt"], "Resource": [kms_key_arn]},
    )


class ServingPlatform(pulumi.ComponentResource):
    namespace: str
    service_account: str
    model_cache_claim: str
    gateway_name: str
    serving_role_arn: pulumi.Output[str]
    ready: list[pulumi.Resource]  # what every model Deployment waits for

    def __init__(self, name: str, args: PlatformArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("llm-serving:infra:ServingPlatform", name, None, opts)
        cfg = args.config
        ns_name = cfg.serving.namespace
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=args.provider)
        aws_opts = pulumi.ResourceOptions(parent=self)

        namespace = k8s.core.v1.Namespace(
            f"{name}-ns",
            metadata={"name": ns_name, "labels": {**platform_labels("namespace"),
                                                   "pod-security.kubernetes.io/enforce": "restricted"}},
            opts=k8s_opts)
        ns_opts = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[namespace])

        role, sa = irsa_service_account(
            f"{name}-model-server", f"{name}-model-server", namespace=ns_name, service_account=SERVICE_ACCOUNT,
            labels=platform_labels("model-server"), oidc_provider_arn=args.oidc_provider_arn,
            oidc_issuer_url=args.oidc_issuer_url,
            policy=serving_read_policy(args.bucket_arn, cfg.model_storage.model_prefix, args.kms_key_arn),
            tags=args.tags, role_opts=aws_opts, account_opts=ns_opts)
        self.serving_role_arn = role.arn

        pv = k8s.core.v1.PersistentVolume(
            f"{name}-model-cache",
            metadata={"name": f"{ns_name}-model-cache", "labels": platform_labels("model-cache")},
            spec={
                "capacity": {"storage": f"{cfg.model_storage.fsx.storage_capacity_gib}Gi"},
                "volumeMode": "Filesystem",
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "mountOptions": ["flock"],
                "csi": {
                    "driver": "fsx.csi.aws.com",
                    "volumeHandle": args.file_system_id,
                    "readOnly": True,
                    "volumeAttributes": {"dnsname": args.file_system_dns_name,
                                         "mountname": args.file_system_mount_name},
                },
            },
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[args.fsx_csi_addon]))
        pvc = k8s.core.v1.PersistentVolumeClaim(
            f"{name}-model-cache",
            metadata={"name": MODEL_CACHE_PVC, "namespace": ns_name, "labels": platform_labels("model-cache")},
            spec={"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv.metadata["name"],
                  "resources": {"requests": {"storage": f"{cfg.model_storage.fsx.storage_capacity_gib}Gi"}}},
            opts=ns_opts)

        domain = cfg.serving.domain
        certificate = k8s.apiextensions.CustomResource(
            f"{name}-certificate", api_version="cert-manager.io/v1", kind="Certificate",
            metadata={"name": GATEWAY_NAME, "namespace": ns_name, "labels": platform_labels("gateway")},
            spec={"secretName": TLS_SECRET, "dnsNames": [f"*.{domain}", f"*.grpc.{domain}"],
                  "issuerRef": {"kind": "ClusterIssuer", "name": args.cluster_issuer_name},
                  "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"}},
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider,
                                        depends_on=[namespace, *filter(None, [args.cluster_issuer])]))
        gateway = k8s.apiextensions.CustomResource(
            f"{name}-gateway",
            api_version="gateway.networking.k8s.io/v1",
            kind="Gateway",
            # Ready once the controller has programmed it (its load balancer exists), not when the API stores it.
            metadata={"name": GATEWAY_NAME, "namespace": ns_name, "labels": platform_labels("gateway"),
                      "annotations": {"pulumi.com/waitFor": "condition=Programmed",
                                      "pulumi.com/timeoutSeconds": "900"}},
            spec={
                "gatewayClassName": cfg.serving.gateway_class_name,
                # Envoy Gateway copies these onto the Service it creates: an internal NLB.
                "infrastructure": {"annotations": dict(GATEWAY_SERVICE_ANNOTATIONS)},
                "listeners": [
                    {"name": "openai", "protocol": "HTTPS", "port": 443, "hostname": f"*.{domain}",
                     "tls": {"mode": "Terminate", "certificateRefs": [{"kind": "Secret", "name": TLS_SECRET}]},
                     "allowedRoutes": {"namespaces": {"from": "Same"}, "kinds": [{"kind": "HTTPRoute"}]}},
                    {"name": "grpc", "protocol": "HTTPS", "port": 443, "hostname": f"*.grpc.{domain}",
                     "tls": {"mode": "Terminate", "certificateRefs": [{"kind": "Secret", "name": TLS_SECRET}]},
                     "allowedRoutes": {"namespaces": {"from": "Same"}, "kinds": [{"kind": "GRPCRoute"}]}},
                ],
            },
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider,
                                        depends_on=[namespace, certificate, *filter(None, [args.gateway_class])]))

        # Idle connections close from the side that would reuse them (llm_serving/pod_contract.py explains the
        # chain): Envoy drops an idle connection to a pod before the pod's keep-alive ends (no 502 from a reused
        # socket the pod is closing), and an idle client connection before the NLB forgets its flow.
        gateway_ref = [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": GATEWAY_NAME}]
        gateway_opts = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[gateway])
        backend_policy = k8s.apiextensions.CustomResource(
            f"{name}-gateway-backend-traffic", api_version="gateway.envoyproxy.io/v1alpha1",
            kind="BackendTrafficPolicy",
            metadata={"name": GATEWAY_NAME, "namespace": ns_name, "labels": platform_labels("gateway")},
            spec={"targetRefs": gateway_ref,
                  "timeout": {"http": {"connectionIdleTimeout": f"{pc.GATEWAY_UPSTREAM_IDLE_TIMEOUT_S}s"}},
                  # A failed attempt is retried on another pod (llm_serving/pod_contract.py says which and why).
                  "retry": {"numRetries": pc.GATEWAY_RETRIES,
                            "retryOn": {"triggers": list(pc.GATEWAY_RETRY_TRIGGERS),
                                        "httpStatusCodes": list(pc.GATEWAY_RETRY_STATUS_CODES)}}},
            opts=gateway_opts)
        client_policy = k8s.apiextensions.CustomResource(
            f"{name}-gateway-client-traffic", api_version="gateway.envoyproxy.io/v1alpha1",
            kind="ClientTrafficPolicy",
            metadata={"name": GATEWAY_NAME, "namespace": ns_name, "labels": platform_labels("gateway")},
            spec={"targetRefs": gateway_ref,
                  "timeout": {"http": {"idleTimeout": f"{pc.GATEWAY_CLIENT_IDLE_TIMEOUT_S}s"}}},
            opts=gateway_opts)

        # Who may call: API keys at the Gateway and again at the pods (infra/gateway_auth.py).
        self.auth = GatewayAuth(
            f"{name}-auth", config=cfg, provider=args.provider, namespace=ns_name, gateway_name=GATEWAY_NAME,
            namespace_resource=namespace, gateway=gateway, oidc_provider_arn=args.oidc_provider_arn,
            oidc_issuer_url=args.oidc_issuer_url, tags=args.tags, opts=pulumi.ResourceOptions(parent=self))

        keda_ns = k8s.core.v1.Namespace(f"{name}-keda-ns", metadata={"name": KEDA_NAMESPACE,
                                                                       "labels": platform_labels("autoscaling")},
                                        opts=k8s_opts)
        keda = k8s.helm.v3.Release(
            f"{name}-keda",
            name="keda",
            chart="keda",
            version=KEDA_CHART_VERSION,
            namespace=KEDA_NAMESPACE,
            repository_opts={"repo": "https://kedacore.github.io/charts"},
            values={"podSecurityContext": {"operator": {"runAsNonRoot": True}}},
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[keda_ns]))

        self.ready: list[pulumi.Resource] = [sa, pvc, gateway, certificate, keda, backend_policy, client_policy,
                                             *self.auth.ready]
        if cfg.cluster.device_plugin == "auto" and any(g.needs_device_plugin for g in cfg.cluster.gpu_node_groups):
            self.ready.append(self._device_plugin(name, args.provider))
        self.namespace = ns_name
        self.service_account = SERVICE_ACCOUNT
        self.model_cache_claim = MODEL_CACHE_PVC
        self.gateway_name = GATEWAY_NAME
        self.register_outputs({"namespace": ns_name, "servingRoleArn": self.serving_role_arn})

    def _device_plugin(self, name: str, provider: k8s.Provider) -> k8s.apps.v1.DaemonSet:
        """NVIDIA's device plugin, on the GPU nodes whose AMI does not run it (the EKS AL2023 NVIDIA AMIs ship the
        driver and the container toolkit, not the plugin; Bottlerocket's NVIDIA variants run it themselves)."""
        labels = {"app.kubernetes.io/name": "nvidia-device-plugin", **platform_labels("device-plugin")}
        # It talks to the kubelet over a local socket only: no ingress at all.
        k8s.networking.v1.NetworkPolicy(
            f"{name}-nvidia-device-plugin",
            metadata={"name": "nvidia-device-plugin", "namespace": "kube-system", "labels": labels},
            spec={"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nvidia-device-plugin"}},
                  "policyTypes": ["Ingress"], "ingress": []},
            opts=pulumi.ResourceOptions(parent=self, provider=provider))
        return k8s.apps.v1.DaemonSet(
            f"{name}-nvidia-device-plugin",
            metadata={"name": "nvidia-device-plugin", "namespace": "kube-system", "labels": labels},
            spec={
                "selector": {"matchLabels": {"app.kubernetes.io/name": "nvidia-device-plugin"}},
                "updateStrategy": {"type": "RollingUpdate"},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "priorityClassName": "system-node-critical",
                        "nodeSelector": {"llm-serving/device-plugin": "program"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                        "automountServiceAccountToken": False,
                        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                        "containers": [{
                            "name": "nvidia-device-plugin",
                            "image": DEVICE_PLUGIN_IMAGE,
                            "imagePullPolicy": "IfNotPresent",
                            "env": [{"name": "FAIL_ON_INIT_ERROR", "value": "false"}],
                            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}},
                            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                                          "limits": {"cpu": "200m", "memory": "128Mi"}},
                            "volumeMounts": [{"name": "device-plugin",
                                              "mountPath": "/var/lib/kubelet/device-plugins"}],
                        }],
                        "volumes": [{"name": "device-plugin",
                                     "hostPath": {"path": "/var/lib/kubelet/device-plugins"}}],
                    },
                },
            },
            opts=pulumi.ResourceOptions(parent=self, provider=provider))
