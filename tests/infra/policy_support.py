"""A compliant synthetic stack, shaped exactly like `infra.mockrun`'s records, for testing rules one by one.

The rule tests start from `compliant_stack()` (which every policy passes, advisory ones included), break one
thing, and check that the one rule meant to catch it does, with its message. Inputs use the mock runtime's
shapes: camelCase keys, numbers as floats, policy documents as JSON strings, custom timeouts as duration strings.
The real program's resources are checked by `tests/infra/test_policies_stacks.py` on every shipped stack.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from infra.mockrun import MockedResource
from llm_serving.compat import COMPAT_PATH, load_compat
from policies.offline import Finding, evaluate

FINGERPRINT_A = "sha256:" + "a" * 64
FINGERPRINT_B = "sha256:" + "b" * 64
DIGEST = "sha256:" + "c" * 64


def _synthetic_compat() -> str:
    """A test copy of serving_image/compat.toml (docs/architecture.md §3.9): the real file, every section of it,
    moved to Triton 25.10 with vLLM 0.10.2 (release, image, backend branch r25.10 and vLLM version), so the rule
    tests' stacks pin something else than the shipped stacks do."""
    real = load_compat().triton
    text = COMPAT_PATH.read_text().replace(real.release, "25.10")
    return text.replace(f'\nvllm_version = "{real.vllm_version}"\n', '\nvllm_version = "0.10.2"\n', 1)


COMPAT_TOML = _synthetic_compat()
TAGS = {"team": "ml-platform", "env": "prod"}


class SyntheticStack:
    def __init__(self, stack: str = "prod-us-east-1", project: str = "llm-serving",
                 config: Mapping[str, Any] | None = None) -> None:
        self.stack, self.project = stack, project
        self.config: dict[str, Any] = dict(config or {})
        self.resources: list[MockedResource] = []

    def urn(self, type_: str, name: str) -> str:
        return f"urn:pulumi:{self.stack}::{self.project}::{type_}::{name}"

    def add(self, type_: str, name: str, inputs: dict, depends_on: Iterable[str] = (),
            custom_timeouts: dict | None = None, provider: str | None = None) -> MockedResource:
        resource = MockedResource(
            type=type_, name=name, urn=self.urn(type_, name), inputs=inputs, parent=None,
            dependencies=[self.get(d).urn for d in depends_on], custom_timeouts=custom_timeouts, provider=provider,
        )
        self.resources.append(resource)
        return resource

    def get(self, name: str) -> MockedResource:
        found = [r for r in self.resources if r.name == name]
        if len(found) != 1:
            raise KeyError(f"{len(found)} synthetic resources named {name!r}")
        return found[0]

    def remove(self, name: str) -> None:
        gone = self.get(name)
        self.resources.remove(gone)
        for r in self.resources:
            if gone.urn in r.dependencies:
                r.dependencies.remove(gone.urn)

    def models(self) -> list[dict]:
        return self.config["llm-serving:models"]

    def evaluate(self, compat_file: Path | str | None = None, policies=None) -> list[Finding]:
        kwargs = {"policies": policies} if policies is not None else {}
        return evaluate(self.resources, self.stack, self.project, self.config, compat_file=compat_file, **kwargs)


def model(model_id: str = "llama", versions: Iterable[tuple[str, str]] = (("v1", FINGERPRINT_A),),
          strategy: str = "red-black", **extra: Any) -> dict:
    entry = {
        "id": model_id,
        # python: a kind whose fingerprint comes from its own config.pbtxt, so the rules' tests can give versions
        # any fingerprint (every vllm package has the vLLM contract's one, infra.config checks)
        "kind": "python",
        "replicas": 2,
        "gpu": {"nodeGroup": "gpu", "count": 1},
        "strategy": strategy,
        "versions": [
            {"version": v, "package": f"s3://models-prod/models/model-cache/{model_id}/{v}/", "ioFingerprint": fp}
            for v, fp in versions
        ],
        "loadTimeSeconds": 900,
    }
    if strategy == "red-black":
        entry["active"] = next(iter(versions))[0]
    entry.update(extra)
    return entry


def deployment_inputs(model_id: str, version: str, replicas: int = 2, env: str = "prod") -> dict:
    pod_labels = {
        "app.kubernetes.io/name": model_id,
        "app.kubernetes.io/version": version,
        "app.kubernetes.io/component": "model-server",
        "app.kubernetes.io/part-of": "llm-serving",
        "app.kubernetes.io/managed-by": "pulumi",
        "team": "ml-platform",
        "env": env,
    }
    hardened = {
        "runAsNonRoot": True,
        "runAsUser": 1000.0,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{model_id}-{version}", "namespace": "llm-serving", "labels": dict(pod_labels)},
        "spec": {
            "replicas": float(replicas),
            "selector": {"matchLabels": {"app.kubernetes.io/name": model_id, "app.kubernetes.io/version": version}},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "securityContext": {"runAsNonRoot": True, "fsGroup": 1000.0},
                    "terminationGracePeriodSeconds": 120.0,
                    "nodeSelector": {"llm-serving/gpu-node-group": "gpu"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "topologySpreadConstraints": [{
                        "maxSkew": 1.0, "topologyKey": "topology.kubernetes.io/zone",
                        "whenUnsatisfiable": "ScheduleAnyway",
                        "labelSelector": {"matchLabels": {"app.kubernetes.io/name": model_id}},
                    }],
                    "containers": [{
                        "name": "server",
                        "image": f"123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-serving@{DIGEST}",
                        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"},
                                {"name": "LLM_SERVING_PACKAGE",
                                 "value": f"/mnt/model-cache/models/model-cache/{model_id}/{version}"},
                                {"name": "LLM_SERVING_MODEL_ID", "value": model_id},
                                {"name": "LLM_SERVING_MODEL_VERSION", "value": version},
                                {"name": "LLM_SERVING_IO_FINGERPRINT", "value": FINGERPRINT_A},
                                {"name": "LLM_SERVING_MODEL_CACHE", "value": "/mnt/model-cache"},
                                {"name": "LLM_SERVING_PARALLEL", "value": "tensor=1,pipeline=1,data=1"},
                                {"name": "PROMETHEUS_MULTIPROC_DIR", "value": "/var/run/llm-serving/prometheus"},
                                {"name": "LLM_SERVING_API_KEYS_FILE", "value": "/etc/llm-serving/api-keys"},
                                {"name": "LLM_SERVING_REQUIRE_API_KEYS", "value": "1"}],
                        "ports": [{"containerPort": p} for p in (8000.0, 8001.0, 8002.0, 9000.0)],
                        "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "64Gi"},
                                      "requests": {"nvidia.com/gpu": "1", "cpu": "8", "memory": "64Gi"}},
                        "securityContext": hardened,
                        "startupProbe": {"httpGet": {"path": "/v2/health/ready", "port": 8000.0},
                                         "periodSeconds": 10.0, "failureThreshold": 100.0},
                        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": 8000.0},
                                           "periodSeconds": 5.0},
                        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": 8000.0},
                                          "periodSeconds": 10.0},
                        "volumeMounts": [{"name": "model-cache", "mountPath": "/mnt/model-cache", "readOnly": True},
                                         {"name": "api-keys", "mountPath": "/etc/llm-serving/api-keys",
                                          "readOnly": True}],
                    }],
                    "volumes": [{"name": "model-cache",
                                 "persistentVolumeClaim": {"claimName": "model-cache", "readOnly": True}},
                                {"name": "api-keys", "secret": {"secretName": "llm-serving-api-keys"}}],
                },
            },
        },
    }


def network_policy(name: str, selector: dict) -> dict:
    """What infra.serving renders: serving ports from the gateway's proxies, metrics from monitoring."""
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "llm-serving"},
        "spec": {"podSelector": {"matchLabels": dict(selector)}, "policyTypes": ["Ingress"], "ingress": [
            {"ports": [{"protocol": "TCP", "port": p} for p in (8000.0, 8001.0, 9000.0)],
             "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}},
                       "podSelector": {"matchLabels": {"gateway.envoyproxy.io/owning-gateway-name": "llm-serving"}}}]},
            {"ports": [{"protocol": "TCP", "port": 8002.0}],
             "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}]},
    }


def add_model_version(stack: SyntheticStack, model_id: str, version: str, replicas: int = 2,
                      weight: int = 100, route: bool = True) -> None:
    """Deployment, Service, PodDisruptionBudget and (optionally) its own HTTPRoute for one model version."""
    name = f"{model_id}-{version}"
    stack.add("kubernetes:apps/v1:Deployment", name, deployment_inputs(model_id, version, replicas),
              depends_on=["serving-image", "model-cache"], custom_timeouts={"create": "30m", "update": "30m"})
    selector = {"app.kubernetes.io/name": model_id, "app.kubernetes.io/version": version}
    stack.add("kubernetes:core/v1:Service", f"{name}-svc", {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "llm-serving"},
        "spec": {"selector": selector, "ports": [{"name": "openai", "port": 9000.0}]},
    })
    stack.add("kubernetes:networking.k8s.io/v1:NetworkPolicy", f"{name}-netpol", network_policy(name, selector))
    stack.add("kubernetes:policy/v1:PodDisruptionBudget", f"{name}-pdb", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": "llm-serving"},
        "spec": {"maxUnavailable": 1.0, "selector": {"matchLabels": selector}},
    })
    if route:
        stack.add("kubernetes:gateway.networking.k8s.io/v1:HTTPRoute", f"{name}-route", {
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": "llm-serving", "annotations": {"pulumi.com/waitFor": json.dumps([
                f'jsonpath={{.status.parents[0].conditions[?(@.type=="{c}")].status}}=True'
                for c in ("Accepted", "ResolvedRefs")])}},
            "spec": {"parentRefs": [{"name": "llm-gateway"}],
                     "rules": [{"backendRefs": [{"name": name, "port": 9000.0, "weight": float(weight)}]}]},
        }, depends_on=[name, f"{name}-svc", *(["gateway-crds"] if _has(stack, "gateway-crds") else [])])


def _has(stack: SyntheticStack, name: str) -> bool:
    return any(r.name == name for r in stack.resources)


def compliant_stack(stack_name: str = "prod-us-east-1") -> SyntheticStack:
    env = stack_name.split("-", 1)[0]
    def tags() -> dict:  # a fresh dict per resource, so a test can change one resource's tags
        return {**TAGS, "env": env}

    stack = SyntheticStack(stack_name, config={
        "aws:region": "us-east-1",
        "llm-serving:environment": env,
        "llm-serving:models": [model()],
    })
    stack.add("aws:kms/key:Key", "models-key", {"enableKeyRotation": True, "tags": tags()})
    stack.add("aws:s3/bucket:Bucket", "models", {"bucket": f"models-{env}-us-east-1", "tags": tags()})
    bucket_arn = f"arn:aws:s3:::models-{env}-us-east-1"
    stack.add("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
              "models-sse", {"bucket": f"models-{env}-us-east-1", "rules": [{
                  "applyServerSideEncryptionByDefault": {"sseAlgorithm": "aws:kms", "kmsMasterKeyId": "arn:key"},
                  "bucketKeyEnabled": True}]}, depends_on=["models", "models-key"])
    stack.add("aws:s3/bucketVersioning:BucketVersioning", "models-versioning", {
        "bucket": f"models-{env}-us-east-1", "versioningConfiguration": {"status": "Enabled"}}, depends_on=["models"])
    stack.add("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock", "models-pab", {
        "bucket": f"models-{env}-us-east-1", "blockPublicAcls": True, "blockPublicPolicy": True,
        "ignorePublicAcls": True, "restrictPublicBuckets": True}, depends_on=["models"])
    stack.add("aws:s3/bucketPolicy:BucketPolicy", "models-policy", {
        "bucket": f"models-{env}-us-east-1",
        "policy": json.dumps({"Version": "2012-10-17", "Statement": [{
            "Sid": "DenyInsecureTransport", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
            "Resource": [bucket_arn, f"{bucket_arn}/*"],
            "Condition": {"Bool": {"aws:SecureTransport": "false"}}}]}),
    }, depends_on=["models"])
    stack.add("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration", "models-lifecycle", {
        "bucket": f"models-{env}-us-east-1", "rules": [{
            "id": "expire-noncurrent", "status": "Enabled", "filter": {},
            "noncurrentVersionExpiration": {"noncurrentDays": 30.0}}]}, depends_on=["models"])

    stack.add("aws:ec2/securityGroup:SecurityGroup", "nodes-sg", {"vpcId": "vpc-1", "description": "nodes"})
    stack.add("aws:ec2/securityGroup:SecurityGroup", "fsx-sg", {"vpcId": "vpc-1", "description": "FSx for Lustre"})
    for name, low, high in (("fsx-lnet", 988.0, 988.0), ("fsx-servers", 1018.0, 1023.0)):
        stack.add("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", name, {
            "securityGroupId": "sg-fsx", "ipProtocol": "tcp", "fromPort": low, "toPort": high,
            "referencedSecurityGroupId": "sg-nodes"}, depends_on=["fsx-sg", "nodes-sg"])
    stack.add("aws:fsx/lustreFileSystem:LustreFileSystem", "model-cache-fs", {
        "deploymentType": "PERSISTENT_2", "storageCapacity": 2400.0, "perUnitStorageThroughput": 250.0,
        "subnetIds": "subnet-1", "securityGroupIds": ["sg-fsx"], "kmsKeyId": "arn:key", "tags": tags(),
    }, depends_on=["fsx-sg", "models-key"])

    stack.add("aws:eks/cluster:Cluster", "cluster", {
        "vpcConfig": {"endpointPrivateAccess": True, "endpointPublicAccess": False, "subnetIds": ["subnet-1"]},
        "encryptionConfig": {"provider": {"keyArn": "arn:key"}, "resources": ["secrets"]},
        "enabledClusterLogTypes": ["api", "audit", "authenticator"],
        "tags": tags()})
    stack.add("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", "cluster-api-runner", {
        "securityGroupId": "sg-cluster", "ipProtocol": "tcp", "fromPort": 443.0, "toPort": 443.0,
        "cidrIpv4": "10.0.0.0/16"}, depends_on=["cluster"])
    for addon, settings in (("vpc-cni", '{"enableNetworkPolicy": "true"}'), ("eks-pod-identity-agent", None)):
        stack.add("aws:eks/addon:Addon", addon, {"clusterName": "cluster", "addonName": addon, "tags": tags(),
                                                  **({"configurationValues": settings} if settings else {})},
                  depends_on=["cluster"])
    stack.add("aws:ec2/launchTemplate:LaunchTemplate", "nodes-lt", {
        "metadataOptions": {"httpEndpoint": "enabled", "httpTokens": "required", "httpPutResponseHopLimit": 1.0},
        "blockDeviceMappings": [{"deviceName": "/dev/xvda", "ebs": {"encrypted": "true", "volumeSize": 500.0}}],
        "tags": tags()})
    stack.add("aws:eks/nodeGroup:NodeGroup", "gpu", {
        "launchTemplate": {"id": "lt-1", "version": "1"},
        "clusterName": "cluster", "amiType": "AL2023_x86_64_NVIDIA", "instanceTypes": ["g6e.12xlarge"],
        "scalingConfig": {"minSize": 1.0, "desiredSize": 2.0, "maxSize": 4.0},
        "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}],
        "labels": {"nvidia.com/gpu.present": "true", "llm-serving/gpu-node-group": "gpu"}, "tags": tags(),
    }, depends_on=["cluster", "nodes-lt"])
    stack.add("aws:iam/policy:Policy", "serving-read-models", {"policy": json.dumps({
        "Version": "2012-10-17", "Statement": [
            {"Sid": "ReadModels", "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": f"{bucket_arn}/models/*"},
            {"Sid": "ListModels", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": bucket_arn,
             "Condition": {"StringLike": {"s3:prefix": ["models/*"]}}},
            {"Sid": "Decrypt", "Effect": "Allow", "Action": "kms:Decrypt",
             "Resource": "arn:aws:kms:us-east-1:123456789012:key/1234abcd"},
            {"Sid": "EcrLogin", "Effect": "Allow", "Action": "ecr:GetAuthorizationToken", "Resource": "*"},
        ]}), "tags": tags()})
    oidc = "oidc.eks.us-east-1.amazonaws.com/id/ABC"
    stack.add("aws:iam/role:Role", "model-server", {"assumeRolePolicy": json.dumps({
        "Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Action": "sts:AssumeRoleWithWebIdentity",
            "Principal": {"Federated": f"arn:aws:iam::123456789012:oidc-provider/{oidc}"},
            "Condition": {"StringEquals": {f"{oidc}:sub": "system:serviceaccount:llm-serving:model-server",
                                           f"{oidc}:aud": "sts.amazonaws.com"}}}]}), "tags": tags()})
    stack.add("aws:ecr/repository:Repository", "serving-repo", {
        "imageTagMutability": "IMMUTABLE", "imageScanningConfiguration": {"scanOnPush": True}, "tags": tags()})
    stack.add("docker-build:index:Image", "serving-image", {
        "context": {"location": "."}, "dockerfile": {"location": "serving_image/Dockerfile"}, "push": True,
        "buildArgs": {"TRITON_IMAGE_TAG": "25.10-vllm-python-py3"},
        "tags": ["123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-serving:latest"],
    }, depends_on=["serving-repo"])

    stack.add("kubernetes:core/v1:PersistentVolume", "model-cache-pv", {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "model-cache"},
        "spec": {"capacity": {"storage": "2400Gi"}, "accessModes": ["ReadOnlyMany"],
                 "csi": {"driver": "fsx.csi.aws.com", "volumeHandle": "fs-1",
                         "volumeAttributes": {"dnsname": "fs-1.fsx", "mountname": "abc"}}},
    }, depends_on=["model-cache-fs"])
    stack.add("kubernetes:core/v1:PersistentVolumeClaim", "model-cache", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "model-cache", "namespace": "llm-serving"},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": "model-cache",
                 "resources": {"requests": {"storage": "2400Gi"}}},
    }, depends_on=["model-cache-pv"])
    # The bootstrap (infra/bootstrap.py): the Gateway API CRDs before the routes, Karpenter for the GPU pool.
    stack.add("kubernetes:helm.sh/v3:Release", "gateway-crds", {
        "chart": "oci://docker.io/envoyproxy/gateway-crds-helm", "version": "v1.8.2", "name": "gateway-crds"})
    stack.add("kubernetes:helm.sh/v3:Release", "keda", {"chart": "keda", "version": "2.17.2", "name": "keda"})
    stack.add("kubernetes:helm.sh/v3:Release", "karpenter-crd", {
        "chart": "oci://public.ecr.aws/karpenter/karpenter-crd", "version": "1.8.1", "name": "karpenter-crd"})
    stack.add("kubernetes:karpenter.sh/v1:NodePool", "gpu-pool", {
        "apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": "gpu"},
        "spec": {"limits": {"nvidia.com/gpu": "8"}, "template": {
            "metadata": {"labels": {"llm-serving/gpu-node-group": "gpu"}},
            "spec": {"requirements": [{"key": "node.kubernetes.io/instance-type", "operator": "In",
                                       "values": ["g6e.12xlarge"]}]}}}}, depends_on=["karpenter-crd"])
    # Caller authentication (infra/gateway_auth.py): the keys from the secret store, API keys on the Gateway.
    stack.add("kubernetes:helm.sh/v3:Release", "external-secrets", {
        "chart": "external-secrets", "version": "0.16.2", "name": "external-secrets"})
    stack.add("kubernetes:external-secrets.io/v1:ExternalSecret", "api-keys", {
        "apiVersion": "external-secrets.io/v1", "kind": "ExternalSecret",
        "metadata": {"name": "llm-serving-api-keys", "namespace": "llm-serving"},
        "spec": {"secretStoreRef": {"kind": "SecretStore", "name": "aws-secrets-manager"},
                 "target": {"name": "llm-serving-api-keys"}, "dataFrom": [{"extract": {"key": "api-keys"}}]}},
        depends_on=["external-secrets"])
    stack.add("kubernetes:gateway.envoyproxy.io/v1alpha1:SecurityPolicy", "gateway-api-keys", {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "SecurityPolicy",
        "metadata": {"name": "llm-serving-api-keys", "namespace": "llm-serving"},
        "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "llm-gateway"}],
                 "apiKeyAuth": {"credentialRefs": [{"name": "llm-serving-api-keys"}],
                                "extractFrom": [{"headers": ["authorization"]}]}}}, depends_on=["gateway-crds"])
    add_model_version(stack, "llama", "v1")
    return stack


def write_compat(directory: Path, text: str = COMPAT_TOML) -> Path:
    path = Path(directory) / "compat.toml"
    path.write_text(text)
    return path


def fired(findings: Iterable[Finding]) -> set[str]:
    """The names of the policies that reported something."""
    return {f.policy for f in findings}


def messages(findings: Iterable[Finding], policy: str) -> list[str]:
    return [f.message for f in findings if f.policy == policy]


def inputs_of(stack: SyntheticStack, name: str) -> dict:
    return stack.get(name).inputs


def container(stack: SyntheticStack, deployment: str = "llama-v1") -> dict:
    return stack.get(deployment).inputs["spec"]["template"]["spec"]["containers"][0]


def pod(stack: SyntheticStack, deployment: str = "llama-v1") -> dict:
    return stack.get(deployment).inputs["spec"]["template"]["spec"]
