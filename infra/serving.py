"""Per model: a Deployment, Service, PodDisruptionBudget and KEDA ScaledObject per served version, and the Gateway
API routes (HTTPRoute for the OpenAI and KServe HTTP APIs, GRPCRoute for KServe gRPC).

Red-black (docs/architecture.md §4) inside one update is ordered by resource dependencies:

    candidate Deployment (Pulumi waits until it is ready, timeouts > 10 min)
        -> HTTPRoute/GRPCRoute weights
            -> active Deployment/ScaledObject scale-down

so if the candidate never becomes ready the update fails before any route changes: traffic never moves to an
unhealthy version. The replicas and weights come from `infra.rollout.planner`. Versioned models get one
Deployment/Service/route set per version, each with its own hostname.

Autoscaling: KEDA ScaledObjects with a Prometheus trigger on the queue (scraped from the merged metrics on port 8002):
`vllm:num_requests_waiting` for an LLM, Triton's `nv_inference_pending_request_count` for the other kinds, which have
no vLLM engine. Chosen over an HPA with an external metric because KEDA queries PromQL directly: no
prometheus-adapter rule set to keep in sync with the metric names, and the query (a sum over one version's pods)
lives next to the Deployment it scales. The planner's replicas are the ScaledObject's floor, so autoscaling can add
capacity under load but can never undo a red-black split.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from infra.bootstrap import GATEWAY_NAMESPACE
from infra.config import ModelConfig, StackConfig, TritonPin, active_version
from infra.instances import cpu_pod_share, pod_share
from infra.naming import (
    CPU_NODE_GROUP_LABEL,
    GPU_NODE_GROUP_LABEL,
    cost_labels,
    instance_name,
    model_labels,
    selector_labels,
    version_slug,
)
from infra.rollout.planner import VersionShare, plan_red_black
from infra.serving_platform import GATEWAY_NAME
from llm_serving import pod_contract as pc

# The pod contract (docs/architecture.md §3.10b) owns every port, path, env name and the user id the image expects.
PORTS = pc.PORTS
MODEL_CACHE_MOUNT = pc.MODEL_CACHE_MOUNT
RUN_AS_UID = pc.RUN_AS_UID
PROBE_PERIOD_SECONDS = 10
PRESTOP_SLEEP_SECONDS = 15  # lets the gateway drop the pod from its endpoints before SIGTERM
DEFAULT_TIMEOUT_MINUTES = 10  # the Kubernetes provider's own default, which a GPU start routinely exceeds
# The Kubernetes provider has no await logic for custom resources: without this annotation a route counts as created
# the moment the API server stores it, and the active version's scale-down (which depends on the route) could start
# before the gateway controller has accepted the new weights and resolved every backend. With it, Pulumi waits for
# both conditions the controller sets on the route's status for our Gateway (docs/first-update.md, "Routes wait").
ROUTE_CONDITIONS = ("Accepted", "ResolvedRefs")
ROUTE_AWAIT_ANNOTATIONS = {
    "pulumi.com/waitFor": json.dumps(
        [f'jsonpath={{.status.parents[0].conditions[?(@.type=="{c}")].status}}=True' for c in ROUTE_CONDITIONS]),
    "pulumi.com/timeoutSeconds": "300",
}


@dataclass(frozen=True)
class ServingContext:
    """What every model's resources share on one cluster."""

    stack: StackConfig
    provider: k8s.Provider
    namespace: str
    service_account: str
    model_cache_claim: str
    gateway_name: str
    image_ref: pulumi.Input[str]  # <repository>@<digest> of the image this update builds
    repository_url: pulumi.Input[str]
    triton: TritonPin
    depends_on: list[pulumi.Resource]
    # Environment a model's containers get beside the pod contract's, by model id: the batch path's store
    # (infra/batch.py, BatchStore.serving_env), which turns the Files and Batches API on in that model's pods.
    model_env: dict[str, dict[str, pulumi.Input[str]]] = field(default_factory=dict)


def deployment_timeouts(model: ModelConfig) -> pulumi.CustomTimeouts:
    """Longer than the provider's 10-minute default: the model's load budget, plus node scale-up and image pull."""
    minutes = max(DEFAULT_TIMEOUT_MINUTES * 2, math.ceil(model.load_time_seconds / 60) + 15)
    return pulumi.CustomTimeouts(create=f"{minutes}m", update=f"{minutes}m", delete="15m")


def package_path(model_id: str, version: str) -> str:
    """Where the pod reads the package of (model id, version) in place: the unpacked directory `llm-serving publish`
    wrote under `model-cache/` (llm_serving.pod_contract.model_cache_key), below the path at which the data
    repository association presents the bucket's model prefix on the FSx root (mounted at MODEL_CACHE_MOUNT)."""
    return pc.package_path_in_pod(model_id, version)


def package_version(stack: StackConfig, package: str) -> str:
    """The version of the package a stack's version entry names (its own, or the one whose image it replaces)."""
    return pc.parse_package_uri(package, stack.model_storage.model_prefix)[2]


def container_env(model_id: str, version: str, io_fingerprint: str,
                  companions: tuple[tuple[str, str], ...] = (),
                  parallel: tuple[int, int, int] | None = None, tasks: tuple[str, ...] = ()) -> list[dict]:
    """The model container's environment for the package of (model id, package version): what the startup reads
    (pc.STARTUP_ENV), and the image's ENV that the pod must not leave to the image's defaults (pc.POD_ENV: the
    metrics directory, offline hubs, the caches on the writable cache volume). `companions`: the (id, version) of
    the other packages the pod serves on the same Triton (an ensemble's steps), in pc.ENV_COMPANION_PACKAGES.
    `parallel`: a vllm model's declared engine layout (tensor, pipeline, data), in pc.ENV_PARALLEL. `tasks`: a vllm
    model's, whose engines' shares of the GPUs' memory (the fit's budget, infra.model_fit) go in
    pc.ENV_ENGINE_MEMORY."""
    env = {
        pc.ENV_MODEL_ID: model_id,
        pc.ENV_MODEL_VERSION: version,
        pc.ENV_PACKAGE: package_path(model_id, version),
        pc.ENV_IO_FINGERPRINT: io_fingerprint,
        pc.ENV_MODEL_CACHE: pc.MODEL_CACHE_MOUNT,
        **pc.POD_ENV,
    }
    if companions:
        env[pc.ENV_COMPANION_PACKAGES] = pc.COMPANION_SEPARATOR.join(package_path(i, v) for i, v in companions)
    if parallel is not None:
        env[pc.ENV_PARALLEL] = pc.parallel_env_value(*parallel)
    if tasks:
        env[pc.ENV_ENGINE_MEMORY] = pc.engine_memory_env_value(pc.engine_memory_shares(tasks))
    return [{"name": k, "value": v} for k, v in env.items()]


CPU_MODEL_SHM = "2Gi"  # /dev/shm of a pod without GPUs: the Python backend's stubs exchange tensors through it


def pod_volumes(claim: str, gpus: int) -> tuple[list[dict], list[dict]]:
    """(volumeMounts, volumes) for the contract's volumes: the model cache read-only from its claim, the rest
    emptyDirs (the root file system is read-only). /dev/shm: 16 GiB per GPU (NCCL, vLLM's workers), CPU_MODEL_SHM
    without GPUs."""
    mounts, volumes = [], []
    for v in pc.VOLUMES:
        mount = {"name": v.name, "mountPath": v.mount_path}
        if v.read_only:
            mount["readOnly"] = True
        mounts.append(mount)
        if v.name == pc.MODEL_CACHE_VOLUME:
            volumes.append({"name": v.name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        elif v.medium == "Memory":
            size = f"{16 * gpus}Gi" if gpus else CPU_MODEL_SHM
            volumes.append({"name": v.name, "emptyDir": {"medium": "Memory", "sizeLimit": size}})
        else:
            volumes.append({"name": v.name, "emptyDir": {"sizeLimit": v.size_limit}})
    return mounts, volumes


API_KEYS_FILE_MODE = 0o440  # the keys' files: readable by the pod's group (fsGroup), nobody else


def api_keys_volume() -> tuple[dict, dict]:
    """(volumeMount, volume) of the clients' API keys: the Secret External Secrets syncs (infra/gateway_auth.py),
    required (no `optional`: a pod without it does not start) and read-only, one file per client."""
    return ({"name": pc.API_KEYS_VOLUME, "mountPath": pc.API_KEYS_MOUNT, "readOnly": True},
            {"name": pc.API_KEYS_VOLUME, "secret": {"secretName": pc.API_KEYS_SECRET,
                                                    "defaultMode": API_KEYS_FILE_MODE}})


def hostnames(stack: StackConfig, model_id: str, version: str | None = None) -> tuple[str, str]:
    """(HTTP hostname, gRPC hostname) of a model's route, or of one version's route for a versioned model."""
    label = model_id if version is None else f"{model_id}-{version_slug(version)}"
    return f"{label}.{stack.serving.domain}", f"{label}.grpc.{stack.serving.domain}"


def model_pod_share(stack: StackConfig, model: ModelConfig):
    """The model pod's CPU, memory and GPUs, from its pool's instance types (infra/instances.py): a share of a GPU
    node by its GPUs, or 1/podsPerNode of a CPU node for a model without GPUs."""
    group = stack.node_group(model)
    if model.gpu is None:
        return cpu_pod_share(group.instance_types, model.pods_per_node or 1)
    return pod_share(group.instance_types, group.gpus_per_node, model.gpu.count)


def node_placement(model: ModelConfig) -> dict:
    """The pod spec's nodeSelector and tolerations: a GPU model selects its GPU node group and tolerates the GPU
    taint; a model without GPUs selects its CPU node group and tolerates nothing (policy serving-cpu-model-no-gpu)."""
    if model.gpu is None:
        return {"nodeSelector": {CPU_NODE_GROUP_LABEL: model.placement}}
    return {"nodeSelector": {GPU_NODE_GROUP_LABEL: model.placement},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}


def companion_packages(model: ModelConfig, version: str) -> tuple[tuple[str, str], ...]:
    """The (id, version) of the other packages a version's pod serves: an ensemble's step models."""
    return tuple((s.id, s.version) for s in model.version(version).steps)


def deployment_spec(ctx: ServingContext, model: ModelConfig, version: str, replicas: int) -> dict:
    stack = ctx.stack
    labels = model_labels(model.id, version)
    gpus = model.gpus
    pkg = model.version(version)
    mounts, volumes = pod_volumes(ctx.model_cache_claim, gpus)
    keys_mount, keys_volume = api_keys_volume()
    mounts, volumes = [*mounts, keys_mount], [*volumes, keys_volume]
    startup_failures = math.ceil(model.load_time_seconds / PROBE_PERIOD_SECONDS)
    image = (pulumi.Output.from_input(ctx.repository_url).apply(lambda url: f"{url}@{pkg.image}") if pkg.image
             else ctx.image_ref)
    container = {
        "name": "model-server",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "env": container_env(model.id, package_version(stack, pkg.package), pkg.io_fingerprint,
                             companion_packages(model, version),
                             (model.layout.tensor, model.layout.pipeline, model.layout.data)
                             if model.kind == "vllm" else None, model.engine_tasks)
               + [{"name": k, "value": v} for k, v in ctx.model_env.get(model.id, {}).items()]
               # The caller's key, required and checked on every serving port (docs/architecture.md §3.12).
               + [{"name": k, "value": v} for k, v in pc.api_key_env().items()],
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in PORTS.items()],
        # §3.2/§3.7: ready only once the engine is; the startup probe's budget is the model's load time.
        "startupProbe": {"httpGet": {"path": pc.READY_PATH, "port": pc.PROBE_PORT_NAME},
                         "periodSeconds": PROBE_PERIOD_SECONDS, "failureThreshold": startup_failures,
                         "timeoutSeconds": 5},
        "readinessProbe": {"httpGet": {"path": pc.READY_PATH, "port": pc.PROBE_PORT_NAME},
                           "periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 5},
        "livenessProbe": {"httpGet": {"path": pc.LIVE_PATH, "port": pc.PROBE_PORT_NAME},
                          "periodSeconds": 10, "failureThreshold": 6, "timeoutSeconds": 5},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        # The GPUs' (or podsPerNode's) share of the smallest node the pool may launch (infra/instances.py).
        "resources": model_pod_share(stack, model).resources(),
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": mounts,
    }
    return {
        "replicas": replicas,
        "revisionHistoryLimit": 3,
        "selector": {"matchLabels": selector_labels(model.id, version)},
        # An image change rolls pod by pod, each new pod ready before an old one leaves: one GPU of surge at most.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {
            "metadata": {"labels": {**labels, **cost_labels(stack.team, stack.environment, model.id)}, "annotations": {
                "prometheus.io/scrape": "true", "prometheus.io/port": str(PORTS[pc.METRICS_PORT_NAME]),
                "prometheus.io/path": pc.METRICS_PATH,
                # What the image pins (serving_image/compat.toml); the startup procedure checks it against the
                # image itself, these make it visible to on-call and the policies without pulling the image.
                "llm-serving/triton-release": ctx.triton.release,
                "llm-serving/vllm-version": ctx.triton.vllm_version or "unknown"}},
            "spec": {
                "serviceAccountName": ctx.service_account,
                # IRSA's web identity token comes in its own projected volume (EKS's pod identity webhook); the
                # Kubernetes API token is not needed by the model server.
                "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": stack.serving.termination_grace_period_seconds,
                "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_UID, "runAsGroup": RUN_AS_UID,
                                    "fsGroup": RUN_AS_UID,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                **node_placement(model),
                "topologySpreadConstraints": [
                    {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                     "whenUnsatisfiable": "ScheduleAnyway",
                     "labelSelector": {"matchLabels": selector_labels(model.id, version)}},
                    {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                     "labelSelector": {"matchLabels": selector_labels(model.id, version)}},
                ],
                "containers": [container],
                "volumes": volumes,
            },
        },
    }


# The queue KEDA scales on, per model kind: vLLM's waiting requests for an LLM; for the other kinds (no vLLM engine in
# the pod) Triton's requests waiting in the model's scheduler queue.
QUEUE_METRICS = {"vllm": "vllm:num_requests_waiting", "python": "nv_inference_pending_request_count",
                 "ensemble": "nv_inference_pending_request_count"}


# Consecutive failed polls of a ScaledObject's trigger (an error, or no series) before KEDA applies its fallback.
FALLBACK_FAILURES = 3


def scaled_object_spec(ctx: ServingContext, model: ModelConfig, share: VersionShare, deployment_name: str) -> dict:
    target = (model.autoscaling.target_queue_depth if model.autoscaling and model.autoscaling.target_queue_depth
              else ctx.stack.serving.target_queue_depth)
    metric = QUEUE_METRICS[model.kind]
    query = (f'sum({metric}{{namespace="{ctx.namespace}",'
             f'app_kubernetes_io_instance="{instance_name(model.id, share.version)}"}})')
    return {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment_name},
        "minReplicaCount": share.replicas,
        "maxReplicaCount": share.max_replicas,
        "pollingInterval": 15,
        # GPU pods take minutes to start: scale down slowly so a short lull does not throw warm replicas away.
        "cooldownPeriod": 600,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
            "scaleDown": {"stabilizationWindowSeconds": 600, "policies": [{"type": "Pods", "value": 1,
                                                                          "periodSeconds": 300}]},
        }}},
        # No data never scales a serving model down. KEDA's Prometheus scaler reads an empty result as 0 unless
        # ignoreNullValues is false: a version whose series are gone (a broken PodMonitor, a Prometheus restart, a
        # relabeling change) would read as an empty queue and shrink to its floor. With "false" an empty result is
        # the scaler's error, and after FALLBACK_FAILURES failed polls KEDA applies `fallback`: `currentReplicas`
        # keeps the replicas the Deployment has (KEDA's ScaledObject specification, "fallback"; it applies to
        # AverageValue triggers, which this is).
        "fallback": {"failureThreshold": FALLBACK_FAILURES, "replicas": share.replicas, "behavior": "currentReplicas"},
        "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
            "serverAddress": ctx.stack.serving.prometheus_address, "query": query, "threshold": str(target),
            "ignoreNullValues": "false",
        }}],
    }


# The labels Envoy Gateway puts on the proxy pods of a Gateway.
GATEWAY_OWNER_NAME_LABEL = "gateway.envoyproxy.io/owning-gateway-name"
GATEWAY_OWNER_NAMESPACE_LABEL = "gateway.envoyproxy.io/owning-gateway-namespace"


def gateway_pod_peer(namespace: str) -> dict:
    """The gateway's data plane as a NetworkPolicy peer: Envoy Gateway runs the proxies of the platform's Gateway in
    its controller's namespace and labels them with the Gateway they serve."""
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": GATEWAY_NAMESPACE}},
            "podSelector": {"matchLabels": {GATEWAY_OWNER_NAME_LABEL: GATEWAY_NAME,
                                            GATEWAY_OWNER_NAMESPACE_LABEL: namespace}}}


def network_policy_spec(ctx: ServingContext, model_id: str, version: str) -> dict:
    """Ingress on the serving ports only from the gateway's proxies (a caller reaches a model through its routes,
    authentication, retries and TLS, never around them) and on the metrics port only from the monitoring namespace.
    Egress is not restricted: the pods reach STS (IRSA) and the Lustre servers, whose addresses are not stable."""
    serving_ports = [{"protocol": "TCP", "port": PORTS[p]}
                     for p in (pc.KSERVE_HTTP_PORT_NAME, pc.KSERVE_GRPC_PORT_NAME, pc.OPENAI_PORT_NAME)]
    return {
        "podSelector": {"matchLabels": selector_labels(model_id, version)},
        "policyTypes": ["Ingress"],
        "ingress": [
            {"ports": serving_ports, "from": [gateway_pod_peer(ctx.namespace)]},
            {"ports": [{"protocol": "TCP", "port": PORTS[pc.METRICS_PORT_NAME]}],
             "from": [{"namespaceSelector": {"matchLabels": {
                 "kubernetes.io/metadata.name": ctx.stack.serving.monitoring_namespace}}}]},
        ],
    }


class ModelVersionServing(pulumi.ComponentResource):
    """One (model, version): Deployment, Service, PodDisruptionBudget, ScaledObject."""

    def __init__(self, name: str, ctx: ServingContext, model: ModelConfig, share: VersionShare,
                 scale_after: list[pulumi.Resource], opts: pulumi.ResourceOptions | None = None):
        """`scale_after`: what must be done before this version's replicas change (the routes, for an active
        version that gives up replicas to a candidate)."""
        super().__init__("llm-serving:serving:ModelVersion", name, None, opts)
        version = share.version
        k8s_name = instance_name(model.id, version)
        labels = model_labels(model.id, version)
        meta = {"name": k8s_name, "namespace": ctx.namespace, "labels": labels}
        base = pulumi.ResourceOptions(parent=self, provider=ctx.provider, depends_on=list(ctx.depends_on))
        scaling = pulumi.ResourceOptions(parent=self, provider=ctx.provider,
                                         depends_on=[*ctx.depends_on, *scale_after])
        self.deployment = k8s.apps.v1.Deployment(
            f"{name}-deployment",
            metadata={**meta, "annotations": {
                # Server-side apply: the HPA that KEDA drives also writes spec.replicas; at each update Pulumi
                # sets the planner's value (the ScaledObject's floor) again.
                "pulumi.com/patchForce": "true"}},
            spec=deployment_spec(ctx, model, version, share.replicas),
            opts=pulumi.ResourceOptions.merge(scaling,
                                              pulumi.ResourceOptions(custom_timeouts=deployment_timeouts(model))),
        )
        self.service = k8s.core.v1.Service(
            f"{name}-service",
            metadata=meta,
            spec={"type": "ClusterIP", "selector": selector_labels(model.id, version), "ports": [
                {"name": port_name, "port": port, "targetPort": port_name,
                 **({"appProtocol": "kubernetes.io/h2c"} if port_name == pc.KSERVE_GRPC_PORT_NAME else {})}
                for port_name, port in PORTS.items()
            ]},
            opts=base,
        )
        self.pdb = k8s.policy.v1.PodDisruptionBudget(
            f"{name}-pdb",
            metadata=meta,
            # maxUnavailable (not minAvailable) so that a version scaled to zero never blocks a node drain.
            spec={"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(model.id, version)}},
            opts=base,
        )
        self.network_policy = k8s.networking.v1.NetworkPolicy(
            f"{name}-netpol",
            metadata=meta,
            spec=network_policy_spec(ctx, model.id, version),
            opts=base,
        )
        self.scaled_object = None
        if share.max_replicas > 0:
            self.scaled_object = k8s.apiextensions.CustomResource(
                f"{name}-scaledobject",
                api_version="keda.sh/v1alpha1",
                kind="ScaledObject",
                metadata=meta,
                spec=scaled_object_spec(ctx, model, share, k8s_name),
                opts=pulumi.ResourceOptions(parent=self, provider=ctx.provider,
                                            depends_on=[*ctx.depends_on, *scale_after, self.deployment]),
            )
        self.register_outputs({"deployment": k8s_name})


def _routes(name: str, ctx: ServingContext, model: ModelConfig, label_version: str, host: tuple[str, str],
            backends: list[tuple[str, int]], parent: pulumi.Resource,
            depends_on: list[pulumi.Resource]) -> list[pulumi.Resource]:
    """HTTPRoute (OpenAI on 9000 under /v1, KServe HTTP on 8000 under /v2) and GRPCRoute (KServe gRPC, 8001)."""
    meta = {"namespace": ctx.namespace, "labels": model_labels(model.id, label_version),
            "annotations": dict(ROUTE_AWAIT_ANNOTATIONS)}
    parent_ref = [{"name": ctx.gateway_name, "sectionName": "openai"}]
    opts = pulumi.ResourceOptions(parent=parent, provider=ctx.provider, depends_on=[*ctx.depends_on, *depends_on])

    def refs(port: int) -> list[dict]:
        return [{"name": svc, "port": port, "weight": weight} for svc, weight in backends]

    http = k8s.apiextensions.CustomResource(
        f"{name}-http", api_version="gateway.networking.k8s.io/v1", kind="HTTPRoute",
        metadata={**meta, "name": f"{name}-http"},
        spec={"parentRefs": parent_ref, "hostnames": [host[0]], "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
             "backendRefs": refs(PORTS[pc.OPENAI_PORT_NAME])},
            {"matches": [{"path": {"type": "PathPrefix", "value": "/v2"}}],
             "backendRefs": refs(PORTS[pc.KSERVE_HTTP_PORT_NAME])},
        ]},
        opts=opts)
    grpc = k8s.apiextensions.CustomResource(
        f"{name}-grpc", api_version="gateway.networking.k8s.io/v1", kind="GRPCRoute",
        metadata={**meta, "name": f"{name}-grpc"},
        spec={"parentRefs": [{"name": ctx.gateway_name, "sectionName": "grpc"}], "hostnames": [host[1]],
              "rules": [{"matches": [{"method": {"service": "inference.GRPCInferenceService"}}],
                         "backendRefs": refs(PORTS[pc.KSERVE_GRPC_PORT_NAME])}]},
        opts=opts)
    return [http, grpc]


@dataclass(frozen=True)
class ServedModel:
    """What the program exports for one model (the stack outputs' per-model shape, llm_serving.stack_outputs)."""

    kind: str
    strategy: str
    versions: list[str]
    active_version: str
    route_weights: dict[str, int]
    replicas: dict[str, int]
    endpoints: dict[str, str]
    version_endpoints: dict[str, dict[str, str]]


def endpoints(host: tuple[str, str]) -> dict[str, str]:
    return {"openai": f"https://{host[0]}/v1", "kserve_http": f"https://{host[0]}", "grpc": f"{host[1]}:443"}


class ModelServing(pulumi.ComponentResource):
    served: ServedModel

    def __init__(self, ctx: ServingContext, model: ModelConfig, opts: pulumi.ResourceOptions | None = None):
        super().__init__("llm-serving:serving:Model", model.id, None, opts)
        if model.strategy == "red-black":
            self.served = self._red_black(ctx, model)
        else:
            self.served = self._versioned(ctx, model)
        self.register_outputs({"activeVersion": self.served.active_version})

    def _red_black(self, ctx: ServingContext, model: ModelConfig) -> ServedModel:
        plan = plan_red_black(model.active, model.replicas, model.candidate, model.weight,
                              model.autoscaling.max_replicas if model.autoscaling else None)
        host = hostnames(ctx.stack, model.id)
        if plan.candidate is None:
            active = ModelVersionServing(instance_name(model.id, plan.active.version), ctx, model, plan.active, [],
                                         pulumi.ResourceOptions(parent=self))
            _routes(model.id, ctx, model, plan.active.version, host,
                    [(instance_name(model.id, plan.active.version), 100)], self,
                    [active.deployment, active.service])
        else:
            # §4's order: the candidate must be ready before the routes move, the routes before the active shrinks.
            candidate = ModelVersionServing(instance_name(model.id, plan.candidate.version), ctx, model,
                                            plan.candidate, [], pulumi.ResourceOptions(parent=self))
            backends = [(instance_name(model.id, s.version), s.weight) for s in plan.shares]
            routes = _routes(model.id, ctx, model, plan.active.version, host, backends, self,
                             [candidate.deployment, candidate.service])
            ModelVersionServing(instance_name(model.id, plan.active.version), ctx, model, plan.active, routes,
                                pulumi.ResourceOptions(parent=self))
        return ServedModel(
            kind=model.kind,
            strategy="red-black",
            versions=[s.version for s in plan.shares],
            active_version=active_version(model),
            route_weights={s.version: s.weight for s in plan.shares},
            replicas={s.version: s.replicas for s in plan.shares},
            endpoints=endpoints(host),
            version_endpoints={},
        )

    def _versioned(self, ctx: ServingContext, model: ModelConfig) -> ServedModel:
        version_endpoints = {}
        for v in model.versions:
            share = VersionShare(v.version, model.replicas, 100,
                                 model.autoscaling.max_replicas if model.autoscaling else model.replicas)
            name = instance_name(model.id, v.version)
            served = ModelVersionServing(name, ctx, model, share, [], pulumi.ResourceOptions(parent=self))
            host = hostnames(ctx.stack, model.id, v.version)
            _routes(name, ctx, model, v.version, host, [(name, 100)], served, [served.deployment, served.service])
            version_endpoints[v.version] = endpoints(host)
        newest = active_version(model)  # by version order, not listing order
        return ServedModel(
            kind=model.kind,
            strategy="versioned",
            versions=[v.version for v in model.versions],
            active_version=newest,
            route_weights={v.version: 100 for v in model.versions},
            replicas={v.version: model.replicas for v in model.versions},
            endpoints=version_endpoints[newest],
            version_endpoints=version_endpoints,
        )
