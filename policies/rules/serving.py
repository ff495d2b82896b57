"""Serving Deployments (the per-model servers, `app.kubernetes.io/component: model-server`).

What a reviewer checks on every model server: the image is immutable (a digest) and built on the pinned Triton and
vLLM (§3.9); a model configured with GPUs asks for whole GPUs and tolerates the GPU taint, while a model without GPUs
(a non-LLM model or an ensemble, on a CPU node group) neither requests nor tolerates them and is not placed on a GPU
pool; it reports started, ready and live, with a startup budget that covers the model's configured load time and a
Pulumi timeout that waits that long; it reads weights from the FSx model cache and downloads nothing at start
(§3.4); it does not run as root.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyResource,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from infra.naming import CPU_NODE_GROUP_LABEL, GPU_NODE_GROUP_LABEL
from llm_serving import pod_contract as pc

from .._props import annotations, as_list, as_number, duration_seconds, get, iter_mappings, k8s_namespace, labels
from ..compat import DEFAULT_PATH as DEFAULT_COMPAT
from ..compat import CompatError, Pins, load_pins
from ..context import PolicyContextError, stack_context
from ..index import StackIndex, is_serving_workload, selector_matches
from ..models import model_configs
from ..workload import (
    DEPLOYMENT,
    GPU_RESOURCE,
    containers,
    effective_security,
    gpu_limit,
    is_true,
    model_identity,
    pod_spec,
    pod_template,
    probe_budget_seconds,
    serving_containers,
)
from .gpu_nodes import is_gpu_node_group

DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
DOCKER_IMAGE = "docker-build:index:Image"
FSX_CSI_DRIVER = "fsx.csi.aws.com"
SERVING_CONTEXT = "serving_image"
SERVING_DOCKERFILE = f"{SERVING_CONTEXT}/Dockerfile"
PULUMI_DEFAULT_TIMEOUT_S = 600.0  # the Kubernetes provider's await timeout when customTimeouts are unset
# What a container must not do at start: fetch weights from S3 or a model hub.
DOWNLOAD_MARKERS = (
    "s3://",
    "huggingface.co",
    "hf.co/",
    "huggingface-cli download",
    "hf download",
    "snapshot_download",
    "aws s3 cp",
    "aws s3 sync",
    "s5cmd",
)
# §3.2's readiness endpoints (KServe v2, which the pod contract's probes ask, and the OpenAI front-end).
READY_PATHS = (pc.READY_PATH, "/health/ready")
_MODEL_READY = re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/ready$")
HUB_TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACEHUB_API_TOKEN")


def _serving(args: ResourceValidationArgs) -> bool:
    return args.resource_type == DEPLOYMENT and is_serving_workload(args.props)


def _cname(container: Mapping[str, Any]) -> str:
    return str(container.get("name") or "?")


# -- image ---------------------------------------------------------------------------------------------------------


def _validate_digest(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _serving(args):
        return
    for container in containers(args.props, init=True):
        image = str(container.get("image") or "")
        if not DIGEST.search(image):
            report(
                f"Deployment {args.name!r} container {_cname(container)!r} uses image {image!r}: pin it by digest "
                f"(...@sha256:<64 hex>) so that a node never pulls something other than what was reviewed",
                None,
            )


_RELEASE = re.compile(r"(\d{2}\.\d{2})")
# A Triton release named inside a value: NGC's image reference, or a tag such as "triton-25.10-vllm-python-py3".
_TRITON_REF = re.compile(r"(?:nvcr\.io/nvidia/tritonserver:|[:/_-]triton-)(\d{2}\.\d{2})")


def _pin_kind(key: str) -> str | None:
    norm = re.sub(r"[^A-Z0-9]+", "_", key.upper())
    if "TRITON" in norm and any(w in norm for w in ("RELEASE", "VERSION", "TAG")):
        return "triton_release"
    if "VLLM" in norm and "VERSION" in norm and "CPU" not in norm:
        return "vllm_version"
    if "BACKEND" in norm and "BRANCH" in norm:
        return "vllm_backend_branch"
    return None


def _stated_pins(items: Iterable[tuple[str, Any]]) -> list[tuple[str, str, str]]:
    """(kind, stated value, where) for every pin a set of key/value pairs states (build args, env, annotations)."""
    found = []
    for key, value in items:
        if not isinstance(value, str):
            continue
        for match in _TRITON_REF.finditer(value):
            found.append(("triton_release", match.group(1), f"{key}={value}"))
        kind = _pin_kind(key)
        if kind == "triton_release":
            release = _RELEASE.search(value)
            found.append((kind, release.group(1) if release else value, f"{key}={value}"))
        elif kind:
            found.append((kind, value, f"{key}={value}"))
    return found


def _deployment_pin_items(props: Mapping[str, Any]) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    items += list(annotations(props).items()) + list(annotations(pod_template(props)).items())
    for container in containers(props, init=True):
        items.append((f"{_cname(container)}.image", container.get("image")))
        for env in iter_mappings(container.get("env")):
            items.append((str(env.get("name")), env.get("value")))
    return items


def _image_pin_items(image: PolicyResource) -> list[tuple[str, Any]]:
    build_args = get(image.props, "buildArgs") or {}
    items = list(build_args.items()) if isinstance(build_args, Mapping) else []
    return items + [(f"tags[{i}]", t) for i, t in enumerate(as_list(get(image.props, "tags")))]


def _built_from_serving_context(image: PolicyResource) -> bool:
    """Built from the serving image's Dockerfile (its context is the repository root)."""
    location = str(get(image.props, "dockerfile", "location") or "").rstrip("/")
    return location == SERVING_DOCKERFILE or location.endswith("/" + SERVING_DOCKERFILE)


def _validate_pins(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    serving = [d for d in index.of_type(DEPLOYMENT) if is_serving_workload(d.props)]
    images = index.of_type(DOCKER_IMAGE)
    if not serving and not images:
        return
    ctx = stack_context(args)
    compat_file = args.get_config().get("compatFile") or DEFAULT_COMPAT
    if not Path(compat_file).is_file():
        # Nothing to compare with (the serving image's issue creates the file); any mismatch once it exists fails.
        args.not_applicable(f"stack {ctx.stack!r}: {compat_file} does not exist yet, so no pin can be compared")
    try:
        pins: Pins = load_pins(compat_file)
    except CompatError as err:
        report(f"stack {ctx.stack!r}: {err}", None)
        return
    expected = pins.as_dict()

    def check(stated: list[tuple[str, str, str]], owner: str, urn: str) -> None:
        for kind, value, where in stated:
            if value != expected[kind]:
                report(
                    f"{owner} states {kind.replace('_', ' ')} {value!r} ({where}) but compat.toml pins "
                    f"{expected[kind]!r}",
                    urn,
                )

    for image in images:
        check(_stated_pins(_image_pin_items(image)), f"image {image.name!r}", image.urn)
    for dep in serving:
        stated = _stated_pins(_deployment_pin_items(dep.props))
        check(stated, f"Deployment {dep.name!r}", dep.urn)
        built = [i for i in images if index.depends_on(dep, i) and _built_from_serving_context(i)]
        if not built and not any(kind == "triton_release" for kind, _, _ in stated):
            report(
                f"Deployment {dep.name!r} runs an image whose Triton release cannot be traced to compat.toml: use "
                f"the digest of the serving image built in this stack from {SERVING_CONTEXT}/, or state the pins "
                f"(triton release {pins.triton_release}, vLLM {pins.vllm_version})",
                dep.urn,
            )


# -- GPUs ----------------------------------------------------------------------------------------------------------


def _validate_gpus(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _serving(args):
        return
    # The model's configuration first: a model without GPUs is held to the opposite rule
    # (serving-cpu-model-no-gpu), so none of the GPU demands below apply to it.
    expected = None
    model_id, _ = model_identity(args.props)
    try:
        model = model_configs(stack_context(args)).get(model_id) if model_id else None
        if model is not None and model.gpu is None:
            return
        expected = model.gpu.count if model else None
    except PolicyContextError as err:
        report(str(err), None)
    gpu_containers = [c for c in containers(args.props) if gpu_limit(c)]
    if not gpu_containers:
        report(
            f"Deployment {args.name!r} has no container with a {GPU_RESOURCE} limit: a model server must hold its "
            f"GPUs (resources.limits[{GPU_RESOURCE}])",
            None,
        )
    for container in gpu_containers:
        limit = gpu_limit(container)
        if limit is None or limit != int(limit) or limit < 1:
            report(f"Deployment {args.name!r} container {_cname(container)!r}: GPU limit {limit} is not a whole "
                   f"number of GPUs", None)
        request = as_number(get(container, "resources", "requests", GPU_RESOURCE))
        if request is not None and request != limit:
            report(f"Deployment {args.name!r} container {_cname(container)!r}: GPU request {request:g} differs "
                   f"from its limit {limit:g}; extended resources need equal requests and limits", None)
        if expected is not None and limit is not None and limit != expected:
            report(f"Deployment {args.name!r} container {_cname(container)!r}: GPU limit {limit:g} differs from "
                   f"the model's configured gpu.count {expected}", None)
    tolerations = list(iter_mappings(pod_spec(args.props).get("tolerations")))
    tolerated = any(
        t.get("key") == GPU_RESOURCE and t.get("effect") in ("NoSchedule", None) and t.get("operator") in
        ("Exists", "Equal", None)
        for t in tolerations
    )
    if gpu_containers and not tolerated:
        report(f"Deployment {args.name!r} does not tolerate the {GPU_RESOURCE}:NoSchedule taint of the GPU node "
               f"groups, so its pods can never be scheduled", None)


# Node labels that place a pod on GPU nodes: the GPU node groups' own (infra/node_groups.py gpu_node_labels).
GPU_NODE_KEYS = (GPU_NODE_GROUP_LABEL, "nvidia.com/gpu.present")


def _gpu_affinity_keys(spec: Mapping[str, Any]) -> list[str]:
    """The GPU node label keys a pod's node affinity names (required or preferred terms, any operator)."""
    affinity = get(spec, "affinity", "nodeAffinity") or {}
    terms = list(iter_mappings(get(affinity, "requiredDuringSchedulingIgnoredDuringExecution",
                                    "nodeSelectorTerms")))
    terms += [get(p, "preference") or {} for p in iter_mappings(
        affinity.get("preferredDuringSchedulingIgnoredDuringExecution"))]
    found = []
    for term in terms:
        for expr in [*iter_mappings(term.get("matchExpressions")), *iter_mappings(term.get("matchFields"))]:
            if expr.get("key") in GPU_NODE_KEYS:
                found.append(str(expr["key"]))
    return found


def _gpu_pools(index: StackIndex) -> set[str]:
    """CPU pool names (CPU_NODE_GROUP_LABEL values) that a node group or NodePool with GPUs also labels its nodes
    with: a pod selecting one may land on a GPU node."""
    found = set()
    for group in index.of_type("aws:eks/nodeGroup:NodeGroup"):
        name = (get(group.props, "labels") or {}).get(CPU_NODE_GROUP_LABEL)
        if name and (is_gpu_node_group(group.props) or GPU_NODE_GROUP_LABEL in (get(group.props, "labels") or {})):
            found.add(name)
    for pool in index.k8s("NodePool"):
        template = get(pool.props, "spec", "template") or {}
        pool_labels = get(template, "metadata", "labels") or {}
        name = pool_labels.get(CPU_NODE_GROUP_LABEL)
        gpu_taint = any(get(t, "key") == GPU_RESOURCE for t in iter_mappings(get(template, "spec", "taints")))
        gpu_limit_set = get(pool.props, "spec", "limits", GPU_RESOURCE) is not None
        if name and (gpu_taint or gpu_limit_set or GPU_NODE_GROUP_LABEL in pool_labels):
            found.add(name)
    return found


def _validate_cpu_models(args: StackValidationArgs, report: ReportViolation) -> None:
    """A model the stack configures without `gpu` runs on a CPU node group: its pods must not request or limit
    GPUs, tolerate the GPU taint (or every taint), or be placed on a GPU node group (by nodeSelector or node
    affinity), and they must select the model's own CPU node group."""
    try:
        models = model_configs(stack_context(args))
    except PolicyContextError as err:
        report(str(err), None)
        return
    index = StackIndex(args.resources)
    gpu_pools = _gpu_pools(index)
    for dep in index.of_type(DEPLOYMENT):
        if not is_serving_workload(dep.props):
            continue
        model_id, _ = model_identity(dep.props)
        model = models.get(model_id) if model_id else None
        if model is None or model.gpu is not None:
            continue
        what = f"Deployment {dep.name!r} serves {model_id!r}, a model without GPUs (nodeGroup {model.node_group!r})"
        for container in containers(dep.props, init=True):
            for section in ("requests", "limits"):
                value = get(container, "resources", section, GPU_RESOURCE)
                if value is not None:
                    report(f"{what}, but container {_cname(container)!r} {section} {GPU_RESOURCE}: {value}; a model "
                           f"without gpu holds no GPU", dep.urn)
        spec = pod_spec(dep.props)
        for t in iter_mappings(spec.get("tolerations")):
            if t.get("key") == GPU_RESOURCE or (not t.get("key") and t.get("operator") == "Exists"):
                report(f"{what}, but it tolerates {t.get('key') or 'every taint'!s}: it could take a GPU node "
                       f"that GPU models wait for", dep.urn)
        selector = spec.get("nodeSelector") or {}
        on_gpu = [k for k in GPU_NODE_KEYS if k in selector] + _gpu_affinity_keys(spec)
        if on_gpu:
            report(f"{what}, but it is placed on GPU nodes ({', '.join(sorted(set(on_gpu)))}); select its CPU node "
                   f"group with {CPU_NODE_GROUP_LABEL}", dep.urn)
        pool = selector.get(CPU_NODE_GROUP_LABEL)
        if pool != model.node_group:
            report(f"{what}, but its nodeSelector {CPU_NODE_GROUP_LABEL} is {pool!r}: select {model.node_group!r}",
                   dep.urn)
        elif pool in gpu_pools:
            report(f"{what}, but CPU pool {pool!r} is also launched by a node group or NodePool with GPUs", dep.urn)


# -- probes and timeouts -------------------------------------------------------------------------------------------


def _load_time(args: ResourceValidationArgs, report: ReportViolation) -> tuple[str | None, float | None]:
    """(model id, its configured loadTimeSeconds), reporting why it is unknown."""
    model_id, _ = model_identity(args.props)
    if not model_id:
        report(f"Deployment {args.name!r} lacks the app.kubernetes.io/name label, so its model (and load time) is "
               f"unknown", None)
        return None, None
    try:
        models = model_configs(stack_context(args))
    except PolicyContextError as err:
        report(str(err), None)
        return model_id, None
    if model_id not in models:
        report(f"Deployment {args.name!r} serves model {model_id!r}, which llm-serving:models does not declare",
               None)
        return model_id, None
    return model_id, float(models[model_id].load_time_seconds)


def _is_ready_endpoint(path: str) -> bool:
    return path in READY_PATHS or bool(_MODEL_READY.match(path))


def _startup_budget(container: Mapping[str, Any]) -> float | None:
    probe = container.get("startupProbe")
    return probe_budget_seconds(probe) if isinstance(probe, Mapping) else None


def _validate_probes(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _serving(args):
        return
    model_id, load_time = _load_time(args, report)
    for container in serving_containers(args.props):
        missing = [p for p in ("startupProbe", "readinessProbe", "livenessProbe") if not container.get(p)]
        if missing:
            report(f"Deployment {args.name!r} container {_cname(container)!r} has no {', '.join(missing)}: a model "
                   f"server needs all three (started, ready for traffic, alive)", None)
        ready_path = get(container, "readinessProbe", "httpGet", "path")
        if ready_path is not None and not _is_ready_endpoint(str(ready_path)):
            report(f"Deployment {args.name!r} container {_cname(container)!r}: the readinessProbe asks {ready_path!r}, "
                   f"not a readiness endpoint of §3.2 ({', '.join(READY_PATHS)}, /v2/models/<model>/ready): traffic "
                   f"could reach a server whose engine is not ready", None)
        live_path = get(container, "livenessProbe", "httpGet", "path")
        if live_path is not None and _is_ready_endpoint(str(live_path)):
            report(f"Deployment {args.name!r} container {_cname(container)!r}: the livenessProbe asks the readiness "
                   f"endpoint {live_path!r}; a busy or draining server would be restarted: use {pc.LIVE_PATH}",
                   None)
        budget = _startup_budget(container)
        if budget is not None and load_time is not None and budget < load_time:
            report(
                f"Deployment {args.name!r} container {_cname(container)!r}: the startupProbe gives up after "
                f"{budget:g}s (initialDelaySeconds + failureThreshold x periodSeconds) but model {model_id!r} is "
                f"configured to load in up to {load_time:g}s (loadTimeSeconds): the kubelet would kill it mid-load",
                None,
            )


def _validate_timeouts(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _serving(args):
        return
    budgets = [b for b in (_startup_budget(c) for c in serving_containers(args.props)) if b is not None]
    if not budgets:
        return  # no startup probe: serving-probes reports it
    needed = max(budgets)
    timeouts = args.opts.custom_timeouts
    for op in ("create", "update"):
        given = duration_seconds(getattr(timeouts, f"{op}_seconds", None)) if timeouts is not None else None
        effective = given if given else PULUMI_DEFAULT_TIMEOUT_S
        if effective < needed:
            shown = f"{given:g}s" if given else f"unset (the provider's default {PULUMI_DEFAULT_TIMEOUT_S:g}s)"
            report(
                f"Deployment {args.name!r}: Pulumi's {op} timeout is {shown}, shorter than the {needed:g}s its "
                f"startupProbe allows: a slow but healthy GPU start would fail the update; set customTimeouts "
                f"{op} to at least the startup budget",
                None,
            )


# -- model source --------------------------------------------------------------------------------------------------


def _fsx_backed(index: StackIndex, namespace: str, claim_name: str) -> tuple[bool, str]:
    claim = index.k8s_named("PersistentVolumeClaim", namespace, claim_name)
    if claim is None:
        return False, f"claim {claim_name!r} is not a PersistentVolumeClaim of this stack (namespace {namespace!r})"
    volume_name = get(claim.props, "spec", "volumeName")
    if volume_name:
        volume = next((v for v in index.k8s("PersistentVolume") if get(v.props, "metadata", "name") == volume_name),
                      None)
        if volume is None:
            return False, f"claim {claim_name!r} binds PersistentVolume {volume_name!r}, which is not in this stack"
        driver = get(volume.props, "spec", "csi", "driver")
        if driver != FSX_CSI_DRIVER:
            return False, f"PersistentVolume {volume_name!r} uses driver {driver!r}, not {FSX_CSI_DRIVER}"
        return True, ""
    class_name = get(claim.props, "spec", "storageClassName")
    storage_class = next(
        (s for s in index.k8s("StorageClass") if get(s.props, "metadata", "name") == class_name), None
    )
    if storage_class is not None and get(storage_class.props, "provisioner") == FSX_CSI_DRIVER:
        return True, ""
    return False, f"claim {claim_name!r} is bound neither to an FSx PersistentVolume nor to an FSx StorageClass"


def _validate_model_cache(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for dep in index.of_type(DEPLOYMENT):
        if not is_serving_workload(dep.props):
            continue
        namespace = k8s_namespace(dep.props)
        fsx_volumes, problems = set(), []
        for volume in iter_mappings(pod_spec(dep.props).get("volumes")):
            claim = get(volume, "persistentVolumeClaim", "claimName")
            if not claim:
                continue
            ok, why = _fsx_backed(index, namespace, claim)
            if ok:
                fsx_volumes.add(volume.get("name"))
                if not is_true(get(volume, "persistentVolumeClaim", "readOnly")):
                    mounted_ro = all(
                        is_true(m.get("readOnly"))
                        for c in containers(dep.props, init=True)
                        for m in iter_mappings(c.get("volumeMounts"))
                        if m.get("name") == volume.get("name")
                    )
                    if not mounted_ro:
                        problems.append(f"the model cache volume {volume.get('name')!r} is mounted read-write")
            else:
                problems.append(why)
        mounted = {
            m.get("name") for c in serving_containers(dep.props) for m in iter_mappings(c.get("volumeMounts"))
        }
        if not fsx_volumes & mounted:
            report(
                f"Deployment {dep.name!r} does not mount the FSx model cache claim into its server"
                + (f" ({'; '.join(problems)})" if problems else "")
                + ": weights must be read from the model cache (§3.4)",
                dep.urn,
            )
        else:
            for problem in problems:
                report(f"Deployment {dep.name!r}: {problem}; serving pods mount the model cache read-only", dep.urn)


def _env_value(container: Mapping[str, Any], name: str) -> str | None:
    for env in iter_mappings(container.get("env")):
        if env.get("name") == name:
            return None if env.get("value") is None else str(env.get("value"))
    return None


def _validate_engine_parallelism(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """A vllm model's pod says its engine's layout (pc.ENV_PARALLEL, what startup checks against the package), and
    that layout uses exactly the GPUs the container holds: read from the rendered Deployment, not from the sizing
    code, so a Deployment that asks for 8 GPUs and runs a 1-GPU engine is refused whatever produced it."""
    if not _serving(args):
        return
    model_id, _ = model_identity(args.props)
    try:
        model = model_configs(stack_context(args)).get(model_id) if model_id else None
    except PolicyContextError as err:
        report(str(err), None)
        return
    if model is None or model.kind != "vllm":
        return
    declared = model.layout
    for container in serving_containers(args.props):
        value = _env_value(container, pc.ENV_PARALLEL)
        where = f"Deployment {args.name!r} container {_cname(container)!r}"
        if value is None:
            report(f"{where} has no {pc.ENV_PARALLEL}: a vllm model's pod states its engine's parallel layout "
                   f"(the stack's models[].parallel, {declared.describe()}), which startup checks against the "
                   f"package", None)
            continue
        try:
            layout = pc.parse_parallel_env(value)
        except pc.PodContractError as err:
            report(f"{where}: {err}", None)
            continue
        product = layout["tensor"] * layout["pipeline"] * layout["data"]
        gpus = gpu_limit(container)
        if gpus is None or product != gpus:
            report(f"{where}: the engine's layout {pc.ENV_PARALLEL}={value} uses {product} GPU(s), the container "
                   f"holds {GPU_RESOURCE}={gpus if gpus is None else f'{gpus:g}'}: vLLM would leave GPUs idle or "
                   f"fail to start; GPUs per pod must equal tensor x pipeline x data", None)
        if layout != declared.model_dump():
            report(f"{where}: {pc.ENV_PARALLEL}={value} differs from the stack's models[].parallel "
                   f"({declared.describe()})", None)


def _validate_engine_memory(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """A vllm model's pod states each engine's share of the GPUs' memory (pc.ENV_ENGINE_MEMORY), one per task the
    stack declares (each task starts an engine that loads the weights), adding up to at most what one engine may
    take: the budget the schema's fit check counted (infra.model_fit) is the one the serving side runs."""
    if not _serving(args):
        return
    model_id, version = model_identity(args.props)
    try:
        ctx = stack_context(args)
        model = model_configs(ctx).get(model_id) if model_id else None
    except PolicyContextError as err:
        report(str(err), None)
        return
    if model is None or model.kind != "vllm":
        return
    tasks = model.engine_tasks
    for container in serving_containers(args.props):
        value = _env_value(container, pc.ENV_ENGINE_MEMORY)
        where = f"Deployment {args.name!r} container {_cname(container)!r}"
        if value is None:
            report(f"{where} has no {pc.ENV_ENGINE_MEMORY}: a vllm model's pod states each engine's share of the "
                   f"GPUs' memory (tasks {', '.join(tasks)}: one engine each); without it every engine takes vLLM's "
                   f"default {pc.ENGINE_MEMORY_BUDGET:g} and the second fails to start", None)
            continue
        try:
            shares = pc.parse_engine_memory_env(value)
        except pc.PodContractError as err:
            report(f"{where}: {err}", None)
            continue
        if set(shares) != set(tasks):
            report(f"{where}: {pc.ENV_ENGINE_MEMORY}={value} budgets tasks {', '.join(shares)}, the stack's "
                   f"models[].tasks are {', '.join(tasks)}: every task's engine needs a share", None)


# Envoy Gateway runs a Gateway's proxies in its controller's namespace and labels them with the Gateway they serve.
GATEWAY_CONTROLLER_NAMESPACE = "envoy-gateway-system"
GATEWAY_OWNER_LABEL = "gateway.envoyproxy.io/owning-gateway-name"
SERVING_PORTS = {pc.PORTS[n] for n in (pc.KSERVE_HTTP_PORT_NAME, pc.KSERVE_GRPC_PORT_NAME, pc.OPENAI_PORT_NAME)}
SERVING_PORT_NAMES = {pc.KSERVE_HTTP_PORT_NAME, pc.KSERVE_GRPC_PORT_NAME, pc.OPENAI_PORT_NAME}


def _rule_ports(rule: Mapping[str, Any]) -> set[str]:
    """What an ingress rule admits: "serving", "metrics" (a rule without ports admits every port: both)."""
    ports = list(iter_mappings(rule.get("ports")))
    if not ports:
        return {"serving", "metrics"}
    found = set()
    for port in ports:
        value = port.get("port")
        number = as_number(value)
        if value is None or (number is not None and number in SERVING_PORTS) or value in SERVING_PORT_NAMES:
            found.add("serving")
        if value is None or number == pc.PORTS[pc.METRICS_PORT_NAME] or value == pc.METRICS_PORT_NAME:
            found.add("metrics")
    return found


def _ns_is(peer: Mapping[str, Any], namespace: str) -> bool:
    return (get(peer, "namespaceSelector", "matchLabels") or {}).get("kubernetes.io/metadata.name") == namespace


def _validate_network_policy(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    policies = index.k8s("NetworkPolicy")
    try:
        serving = stack_context(args).config.get("serving")
    except PolicyContextError:
        serving = None
    monitoring = (serving.get("monitoringNamespace") if isinstance(serving, Mapping) else None) or "monitoring"
    for deployment in index.of_type(DEPLOYMENT):
        if not is_serving_workload(deployment.props):
            continue
        namespace = k8s_namespace(deployment.props)
        pod_labels = labels(pod_template(deployment.props))
        selecting = [n for n in policies if k8s_namespace(n.props) == namespace
                     and selector_matches(get(n.props, "spec", "podSelector", "matchLabels"), pod_labels)
                     and "Ingress" in (get(n.props, "spec", "policyTypes") or ["Ingress"])]
        if not selecting:
            report(f"Deployment {deployment.name!r}: no NetworkPolicy selects its pods; any pod in the cluster "
                   f"reaches its serving ports past the gateway's authentication and routes", deployment.urn)
            continue
        for netpol in selecting:
            for i, rule in enumerate(iter_mappings(get(netpol.props, "spec", "ingress"))):
                peers = list(iter_mappings(rule.get("from")))
                admits = _rule_ports(rule)
                where = f"NetworkPolicy {netpol.name!r} ingress rule #{i}"
                if "serving" in admits and (not peers or not all(
                        _ns_is(p, GATEWAY_CONTROLLER_NAMESPACE)
                        and (get(p, "podSelector", "matchLabels") or {}).get(GATEWAY_OWNER_LABEL) for p in peers)):
                    report(f"{where} admits the serving ports of {deployment.name!r} from "
                           f"{'anywhere' if not peers else 'peers other than the gateway'}; only the gateway's "
                           f"proxies (namespace {GATEWAY_CONTROLLER_NAMESPACE}, label {GATEWAY_OWNER_LABEL}) may "
                           f"call a model", netpol.urn)
                if admits == {"metrics"} and (not peers or not all(_ns_is(p, monitoring) for p in peers)):
                    report(f"{where} admits the metrics port of {deployment.name!r} from "
                           f"{'anywhere' if not peers else 'outside the monitoring namespace'}; only "
                           f"{monitoring!r} scrapes it", netpol.urn)


# The one variable of a serving pod that may name S3: the Batch API's store of client files and results
# (serving_image/batch/config.py ENV_STORE, rendered by infra/batch.py), which the front-end reads and writes while
# it serves and never at start; weights and packages still may not come from S3.
BATCH_STORE_ENV = "LLM_SERVING_BATCH_STORE"


def _strings(container: Mapping[str, Any]) -> Iterable[tuple[str, str]]:
    for field in ("command", "args"):
        for i, value in enumerate(as_list(container.get(field))):
            yield f"{field}[{i}]", str(value)
    for env in iter_mappings(container.get("env")):
        if env.get("name") == BATCH_STORE_ENV:
            continue
        if env.get("value") is not None:
            yield f"env {env.get('name')}", str(env.get("value"))


def _validate_no_download(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _serving(args):
        return
    for container in containers(args.props, init=True):
        for where, text in _strings(container):
            hits = [m for m in DOWNLOAD_MARKERS if m in text.lower()]
            if hits:
                report(
                    f"Deployment {args.name!r} container {_cname(container)!r} {where} = {text!r} refers to "
                    f"{hits[0]!r}: at start the weights come from the model cache path, never from S3 or a hub",
                    None,
                )
        for env in iter_mappings(container.get("env")):
            name = env.get("name")
            if name in HUB_TOKEN_VARS:
                report(f"Deployment {args.name!r} container {_cname(container)!r} sets {name}: a serving pod has no "
                       f"business holding a model hub token", None)
            if name == "HF_HUB_OFFLINE" and str(env.get("value")).lower() not in ("1", "true"):
                report(f"Deployment {args.name!r} container {_cname(container)!r} sets HF_HUB_OFFLINE="
                       f"{env.get('value')!r}: it must be 1", None)


# -- the pod contract ----------------------------------------------------------------------------------------------


def _under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _validate_pod_contract(args: StackValidationArgs, report: ReportViolation) -> None:
    """A Deployment that runs the serving image built in this stack gives it what its startup reads
    (llm_serving.pod_contract, docs/architecture.md §3.10b). What other rules hold (the model cache mount and its
    read-only flag, downloads, probes) is left to them."""
    index = StackIndex(args.resources)
    images = [i for i in index.of_type(DOCKER_IMAGE) if _built_from_serving_context(i)]
    for dep in index.of_type(DEPLOYMENT):
        if not is_serving_workload(dep.props) or not any(index.depends_on(dep, i) for i in images):
            continue
        for container in serving_containers(dep.props):
            where = f"Deployment {dep.name!r} container {_cname(container)!r}"
            env = {e.get("name"): e.get("value") for e in iter_mappings(container.get("env"))}
            missing = [n for n in pc.STARTUP_ENV if n not in env]
            if missing:
                report(f"{where} does not set {', '.join(missing)}: the image's startup procedure reads them "
                       f"(llm_serving/pod_contract.py)", dep.urn)
            package = env.get(pc.ENV_PACKAGE)
            if isinstance(package, str) and (not _under(package, pc.MODEL_CACHE_MOUNT) or package.endswith(".tar.gz")):
                report(f"{where}: {pc.ENV_PACKAGE}={package!r} is not a package directory below the model cache "
                       f"{pc.MODEL_CACHE_MOUNT}: pods read the published package in place", dep.urn)
            metrics_dir = env.get(pc.ENV_MULTIPROC_DIR)
            if isinstance(metrics_dir, str) and metrics_dir != pc.MULTIPROC_DIR:
                report(f"{where}: {pc.ENV_MULTIPROC_DIR}={metrics_dir!r}, but the image and its metrics proxy use "
                       f"{pc.MULTIPROC_DIR!r}", dep.urn)
            if not is_true(get(container, "securityContext", "readOnlyRootFilesystem")):
                continue
            volumes = {v.get("name"): v for v in iter_mappings(pod_spec(dep.props).get("volumes"))}
            writable = [m.get("mountPath") for m in iter_mappings(container.get("volumeMounts"))
                        if not is_true(m.get("readOnly")) and "emptyDir" in (volumes.get(m.get("name")) or {})]
            written = [v for n, v in env.items() if n in (pc.ENV_MULTIPROC_DIR, *pc.CACHE_ENV) and isinstance(v, str)]
            for path in written:
                if not any(_under(path, str(m)) for m in writable):
                    report(f"{where}: {path} is written at start but lies on the read-only root file system (no "
                           f"writable emptyDir mounted there)", dep.urn)


# -- identity ------------------------------------------------------------------------------------------------------


def _validate_non_root(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _serving(args):
        return
    for container in containers(args.props, init=True):
        name = _cname(container)
        if not is_true(effective_security(args.props, container, "runAsNonRoot")):
            report(f"Deployment {args.name!r} container {name!r} does not set securityContext.runAsNonRoot: true "
                   f"(on the container or the pod)", None)
        uid = as_number(effective_security(args.props, container, "runAsUser"))
        if uid == 0:
            report(f"Deployment {args.name!r} container {name!r} runs as user 0 (root)", None)
        if is_true(get(container, "securityContext", "privileged")):
            report(f"Deployment {args.name!r} container {name!r} is privileged", None)


# -- advisory ------------------------------------------------------------------------------------------------------


def _validate_hardening(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _serving(args):
        return
    for container in containers(args.props, init=True):
        name, sc = _cname(container), container.get("securityContext") or {}
        missing = []
        if sc.get("allowPrivilegeEscalation") is not False:
            missing.append("allowPrivilegeEscalation: false")
        if "ALL" not in as_list(get(sc, "capabilities", "drop")):
            missing.append("capabilities.drop: [ALL]")
        seccomp = get(sc, "seccompProfile", "type") or get(pod_spec(args.props), "securityContext",
                                                            "seccompProfile", "type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            missing.append("seccompProfile: RuntimeDefault")
        if missing:
            report(f"Deployment {args.name!r} container {name!r} could also set {', '.join(missing)}", None)


def _validate_spread(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _serving(args):
        return
    keys = [get(c, "topologyKey") for c in iter_mappings(pod_spec(args.props).get("topologySpreadConstraints"))]
    if "topology.kubernetes.io/zone" not in keys:
        report(f"Deployment {args.name!r} does not spread its replicas across zones (topologySpreadConstraints on "
               f"topology.kubernetes.io/zone): one zone's outage would take the model down", None)


def _validate_grace(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not _serving(args):
        return
    grace = as_number(pod_spec(args.props).get("terminationGracePeriodSeconds"))
    if grace is None or grace < 60:
        report(f"Deployment {args.name!r}: terminationGracePeriodSeconds is {grace if grace is not None else 30:g}s "
               f"(Kubernetes' default when unset is 30s); long generations need at least 60s to drain", None)


def _validate_pdb(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    budgets = index.k8s("PodDisruptionBudget")
    for dep in index.of_type(DEPLOYMENT):
        if not is_serving_workload(dep.props):
            continue
        pod_labels = labels(pod_template(dep.props))
        covered = any(
            (sel := get(b.props, "spec", "selector", "matchLabels"))
            and all(pod_labels.get(k) == v for k, v in sel.items())
            for b in budgets
        )
        if not covered:
            report(f"Deployment {dep.name!r} has no PodDisruptionBudget: a node drain may evict every replica at "
                   f"once", dep.urn)


serving_image_digest = ResourceValidationPolicy(
    name="serving-image-digest",
    description="Serving Deployments reference every image by digest.",
    validate=_validate_digest,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_image_pins = StackValidationPolicy(
    name="serving-image-pins",
    description="The serving image's Triton release, vLLM version and backend branch equal serving_image/compat.toml.",
    validate=_validate_pins,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_gpu_resources = ResourceValidationPolicy(
    name="serving-gpu-resources",
    description="Serving Deployments limit whole GPUs (as configured) and tolerate the GPU taint.",
    validate=_validate_gpus,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_engine_parallelism = ResourceValidationPolicy(
    name="serving-engine-uses-pod-gpus",
    description="A vllm model's pod states its engine's parallel layout (tensor x pipeline x data), as the stack "
                "declares it, and that layout uses exactly the GPUs the pod holds.",
    validate=_validate_engine_parallelism,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_engine_memory = ResourceValidationPolicy(
    name="serving-engine-memory-budgeted",
    description="A vllm model's pod gives each engine it starts (one per task) a share of the GPUs' memory, the "
                "shares adding up to at most what one engine may take.",
    validate=_validate_engine_memory,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_network_policy = StackValidationPolicy(
    name="serving-network-policy-gateway-only",
    description="Every model server's pods are selected by a NetworkPolicy that admits the serving ports only from "
                "the gateway's proxies and the metrics port only from the monitoring namespace.",
    validate=_validate_network_policy,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_cpu_model_no_gpu = StackValidationPolicy(
    name="serving-cpu-model-no-gpu",
    description="A model configured without gpu neither requests nor tolerates GPUs and runs on its CPU node group, "
                "never on a GPU node group.",
    validate=_validate_cpu_models,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_probes = ResourceValidationPolicy(
    name="serving-probes",
    description="Model servers have startup, readiness (on a §3.2 ready endpoint) and liveness probes; the "
                "startup budget covers the model's configured load time.",
    validate=_validate_probes,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_update_timeout = ResourceValidationPolicy(
    name="serving-update-timeout",
    description="Pulumi's create/update timeouts of a serving Deployment cover its startup budget.",
    validate=_validate_timeouts,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_model_cache = StackValidationPolicy(
    name="serving-model-from-fsx",
    description="Model servers mount the FSx model-cache claim, read-only.",
    validate=_validate_model_cache,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_pod_contract = StackValidationPolicy(
    name="serving-pod-contract",
    description="Deployments of the serving image give it what its startup reads (llm_serving/pod_contract.py): the "
                "package directory on the model cache, the model's identity and I/O fingerprint, the metrics "
                "directory, and writable volumes for everything it writes.",
    validate=_validate_pod_contract,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_no_download = ResourceValidationPolicy(
    name="serving-no-download-at-start",
    description="Model servers never download weights from S3 or a model hub at start.",
    validate=_validate_no_download,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_non_root = ResourceValidationPolicy(
    name="serving-non-root",
    description="Model servers run as a non-root user and are not privileged.",
    validate=_validate_non_root,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_hardening = ResourceValidationPolicy(
    name="serving-hardening",
    description="Model servers drop capabilities, forbid privilege escalation and use the runtime seccomp profile.",
    validate=_validate_hardening,
    enforcement_level=EnforcementLevel.ADVISORY,
)
serving_zone_spread = ResourceValidationPolicy(
    name="serving-zone-spread",
    description="Model servers spread their replicas across availability zones.",
    validate=_validate_spread,
    enforcement_level=EnforcementLevel.ADVISORY,
)
serving_drain_grace = ResourceValidationPolicy(
    name="serving-drain-grace",
    description="Model servers get at least 60s to drain in-flight requests on termination.",
    validate=_validate_grace,
    enforcement_level=EnforcementLevel.ADVISORY,
)
serving_disruption_budget = StackValidationPolicy(
    name="serving-disruption-budget",
    description="Every model server Deployment is covered by a PodDisruptionBudget.",
    validate=_validate_pdb,
    enforcement_level=EnforcementLevel.ADVISORY,
)

POLICIES = [
    serving_image_digest,
    serving_image_pins,
    serving_gpu_resources,
    serving_engine_parallelism,
    serving_engine_memory,
    serving_network_policy,
    serving_cpu_model_no_gpu,
    serving_probes,
    serving_update_timeout,
    serving_model_cache,
    serving_pod_contract,
    serving_no_download,
    serving_non_root,
    serving_hardening,
    serving_zone_spread,
    serving_drain_grace,
    serving_disruption_budget,
]
