"""The serving platform's Pulumi program: one stack per environment and region (docs/architecture.md §2, §3.6, §4).

    config (validated) -> network -> EKS + node groups -> cluster bootstrap (CRDs, controllers)
        -> model storage (S3 + FSx) -> ECR + serving image
        -> shared Kubernetes objects -> per-model serving -> stack outputs (docs/stack-outputs.md)
    the cluster's monitoring namespace: alert rules, PodMonitor, Grafana dashboard (deploy/observability/)
"""

import pulumi

from infra.batch import BatchArgs, BatchStore
from infra.bootstrap import BootstrapArgs, ClusterBootstrap
from infra.cache_warmer import CacheWarmer, CacheWarmerArgs
from infra.cluster import Cluster, ClusterArgs
from infra.config import from_pulumi_config, triton_pin
from infra.naming import aws_tags
from infra.network import Network, NetworkArgs
from infra.observability import Observability, ObservabilityArgs
from infra.registry import ServingImage, ServingImageArgs
from infra.serving import ModelServing, ServingContext
from infra.serving_platform import PlatformArgs, ServingPlatform
from infra.storage import ModelStorage, ModelStorageArgs
from llm_serving.stack_outputs import SCHEMA_VERSION, ExperimentOutputs, InProcessOutputs, ModelOutputs

cfg = from_pulumi_config()
pin = triton_pin(cfg.serving)
stack = pulumi.get_stack()
tags = aws_tags(stack, cfg.environment, cfg.team)
cluster_name = f"llm-{cfg.environment}-{cfg.region}"

network = Network("network", NetworkArgs(cluster_name=cluster_name, cidr=cfg.network.cidr, vpc_id=cfg.network.vpc_id,
                                         private_subnet_ids=cfg.network.private_subnet_ids, tags=tags))
cluster = Cluster("eks", ClusterArgs(cluster_name=cluster_name, config=cfg.cluster, vpc_id=network.vpc_id,
                                     private_subnet_ids=network.private_subnet_ids, tags=tags), region=cfg.region)
# What a fresh cluster needs before the program's own objects (docs/first-update.md): Gateway API + Envoy Gateway,
# the Prometheus Operator, Karpenter, cert-manager and ExternalDNS, each CRD before its custom resources.
bootstrap = ClusterBootstrap("bootstrap", BootstrapArgs(
    config=cfg, provider=cluster.provider, cluster_name=cluster.name, cluster_endpoint=cluster.endpoint,
    node_role_name=cluster.node_role_name, node_security_group_id=cluster.node_security_group_id,
    private_subnet_ids=network.private_subnet_ids, vpc_id=network.vpc_id,
    node_groups=list(cluster.node_groups.values()), pod_identity_addon=cluster.addons["eks-pod-identity-agent"],
    tags=tags))
storage = ModelStorage("storage", ModelStorageArgs(
    config=cfg, vpc_id=network.vpc_id,
    fsx_subnet_id=network.private_subnet_ids[0], node_security_group_id=cluster.node_security_group_id, tags=tags))
# One build, in the home region, replicated by ECR; every other region runs the home region's digest.
home_image = None
if not cfg.is_home_region:
    organization = pulumi.get_organization() or "organization"
    home_stack = f"{organization}/{pulumi.get_project()}/{cfg.environment}-{cfg.home_region}"
    home_image = pulumi.StackReference(home_stack).get_output("servingImage")
image = ServingImage("serving-image", ServingImageArgs(
    repository_name=f"llm-serving/{cfg.environment}/model-server", triton=pin, kms_key_arn=storage.kms_key_arn,
    replica_regions=tuple(r.region for r in cfg.model_storage.replica_regions), home_image=home_image, tags=tags))
platform = ServingPlatform("platform", PlatformArgs(
    config=cfg, provider=cluster.provider, oidc_provider_arn=cluster.oidc_provider_arn,
    oidc_issuer_url=cluster.oidc_issuer_url, bucket_arn=storage.bucket_arn, kms_key_arn=storage.kms_key_arn,
    file_system_id=storage.file_system_id, file_system_dns_name=storage.file_system_dns_name,
    file_system_mount_name=storage.file_system_mount_name, fsx_csi_addon=cluster.fsx_csi_addon,
    gateway_class=bootstrap.gateway_class, cluster_issuer=bootstrap.cluster_issuer, tags=tags))
# Every package requested for this region resident on its FSx before a rollout may name it (infra/cache_warmer.py).
CacheWarmer("cache-warmer", CacheWarmerArgs(
    config=cfg, provider=cluster.provider, namespace=platform.namespace, model_cache_claim=platform.model_cache_claim,
    image_ref=image.image_ref, bucket_arn=storage.bucket_arn, bucket_name=storage.bucket_name,
    kms_key_arn=storage.kms_key_arn, file_system_id=storage.file_system_id,
    oidc_provider_arn=cluster.oidc_provider_arn, oidc_issuer_url=cluster.oidc_issuer_url,
    depends_on=list(platform.ready), tags=tags))
# The committed alert rules and dashboard, and the scrape of every model server (independent of the models).
Observability("observability", ObservabilityArgs(config=cfg, provider=cluster.provider,
                                                 depends_on=(bootstrap.monitoring,)))

# The batch path (docs/batch.md): the region's non-replicated batch bucket and a worker per LLM (infra/batch.py).
batch = BatchStore("batch", BatchArgs(
    config=cfg, provider=cluster.provider, namespace=platform.namespace, image_ref=image.image_ref,
    oidc_provider_arn=cluster.oidc_provider_arn, oidc_issuer_url=cluster.oidc_issuer_url,
    api_keys_secret_name=platform.auth.secret_name, secret_store=platform.auth.store,
    depends_on=list(platform.ready), tags=tags))
llms = [m for m in cfg.models if m.kind == "vllm"]
batch.grant_serving(platform.serving_role_arn, llms)
ctx = ServingContext(stack=cfg, provider=cluster.provider, namespace=platform.namespace,
                     service_account=platform.service_account, model_cache_claim=platform.model_cache_claim,
                     gateway_name=platform.gateway_name, image_ref=image.image_ref,
                     repository_url=image.repository_url, triton=pin,
                     depends_on=[*platform.ready, *bootstrap.ready, *cluster.node_groups.values()],
                     model_env={m.id: batch.serving_env(m) for m in llms})
models = {}
for model in cfg.models:
    served = ModelServing(ctx, model).served
    if model.kind == "vllm":
        batch.add_worker(model, served.endpoints["openai"])
    models[model.id] = ModelOutputs(
        kind=served.kind, strategy=served.strategy, region=cfg.region, versions=served.versions,
        active_version=served.active_version,
        route_weights=served.route_weights, replicas=served.replicas, endpoints=served.endpoints,
        version_endpoints=served.version_endpoints,
        in_process=InProcessOutputs.model_validate({"versions": {
            v: {"package": cfg.regional_package_uri(model.version(v).package),
                "ioFingerprint": model.version(v).io_fingerprint} for v in served.versions}})
        if model.in_process else None,
    ).model_dump(by_alias=True)
# Experiments as the clients read them (docs/clients.md, "Experiments"), validated by the same shape they parse.
experiments = {e.name: ExperimentOutputs.model_validate({"unit": e.unit, "arms": [
    a.model_dump(by_alias=True) for a in e.arms]}).model_dump(by_alias=True) for e in cfg.experiments}

# The client contract (llm_serving/stack_outputs.py, docs/stack-outputs.md).
pulumi.export("schemaVersion", SCHEMA_VERSION)
pulumi.export("stack", stack)
pulumi.export("environment", cfg.environment)
pulumi.export("region", cfg.region)
pulumi.export("models", models)
pulumi.export("experiments", experiments)
# For operators and other stacks; not part of the client contract.
pulumi.export("clusterName", cluster.name)
pulumi.export("kubeconfig", cluster.kubeconfig)
pulumi.export("modelBucket", storage.bucket_name)
pulumi.export("modelKmsKeyArn", storage.kms_key_arn)  # the home region's replicaRegions[].kmsKeyArn
pulumi.export("modelCacheFileSystemId", storage.file_system_id)
pulumi.export("servingImage", image.image_ref)
pulumi.export("triton", pin.model_dump())
