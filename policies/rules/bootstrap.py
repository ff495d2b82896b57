"""What a fresh cluster needs before the program's own objects (docs/first-update.md).

- Every custom resource's CRD is installed by this stack (a Helm release of the chart that carries it, per
  `infra/charts.py`, or a CustomResourceDefinition object), and the custom resource depends on it, directly or
  through other resources: otherwise the first `pulumi up` on a new cluster fails with "no matches for kind".
- Routes wait for their controller: Pulumi has no await logic for custom resources, so a route without a
  `pulumi.com/waitFor` on the controller's `Accepted` and `ResolvedRefs` conditions counts as done when stored, and
  the old version's scale-down that depends on it can start before any proxy carries the new weights. The Gateway
  likewise waits for `Programmed`.
- Every GPU or CPU pool a model server selects has a node autoscaler (a Karpenter NodePool with the pool's label,
  or a Cluster Autoscaler release), with approved instance types, and a GPU pool has enough GPUs at its peak for the
  models placed on it: red-black's surge pod plus KEDA's maximum replicas. Fixed node groups leave those pods
  pending forever.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from pulumi_policy import EnforcementLevel, PolicyResource, ReportViolation, StackValidationArgs, StackValidationPolicy

from infra.charts import CRD_SOURCES, chart_key
from infra.instances import INSTANCE_FACTS
from infra.naming import CPU_NODE_GROUP_LABEL, GPU_NODE_GROUP_LABEL

from .._props import annotations, as_list, get, k8s_name
from ..context import stack_context
from ..index import StackIndex, is_serving_workload
from ..models import model_configs
from ..workload import DEPLOYMENT
from .capacity import INSTANCE_TYPE_KEY, NODE_GROUP, pool_of
from .gpu_nodes import APPROVED_CPU_INSTANCE_TYPES, APPROVED_INSTANCE_TYPES

HELM_RELEASE = "kubernetes:helm.sh/v3:Release"
CRD = "kubernetes:apiextensions.k8s.io/v1:CustomResourceDefinition"
# API groups served by Kubernetes itself (no CRD needed).
BUILTIN_GROUPS = frozenset({
    "core", "apps", "batch", "policy", "autoscaling", "networking.k8s.io", "rbac.authorization.k8s.io",
    "storage.k8s.io", "apiextensions.k8s.io", "scheduling.k8s.io", "admissionregistration.k8s.io",
    "coordination.k8s.io", "node.k8s.io", "discovery.k8s.io", "certificates.k8s.io", "events.k8s.io",
    "flowcontrol.apiserver.k8s.io", "resource.k8s.io",
})
CLUSTER_AUTOSCALER_CHART = "cluster-autoscaler"


def api_group(resource_type: str) -> str | None:
    """`kubernetes:karpenter.sh/v1:NodePool` -> `karpenter.sh`; built-in and non-Kubernetes types -> None."""
    if not resource_type.startswith("kubernetes:") or resource_type.startswith("kubernetes:helm.sh"):
        return None
    api_version = resource_type.split(":")[1]
    group = api_version.split("/")[0] if "/" in api_version else "core"
    return None if group in BUILTIN_GROUPS else group


def _closure(index: StackIndex, resource: PolicyResource) -> set[str]:
    """URNs of everything `resource` waits for, transitively (dependencies and property dependencies; a parent's
    dependencies are not waited for by its children)."""
    seen: set[str] = set()
    todo = [resource]
    while todo:
        cur = todo.pop()
        deps: list[PolicyResource] = list(cur.dependencies)
        for values in cur.property_dependencies.values():
            deps.extend(values)
        for dep in deps:
            if dep.urn not in seen:
                seen.add(dep.urn)
                todo.append(dep)
    return seen


def _crd_sources(index: StackIndex) -> dict[str, list[PolicyResource]]:
    """API group -> the resources of this stack that install its CRDs."""
    out: dict[str, list[PolicyResource]] = {}
    for release in index.of_type(HELM_RELEASE):
        key = chart_key(str(get(release.props, "chart") or ""))
        for group, source in CRD_SOURCES.items():
            if key == source:
                out.setdefault(group, []).append(release)
    for crd in index.of_type(CRD):
        group = get(crd.props, "spec", "group")
        if group:
            out.setdefault(str(group), []).append(crd)
    return out


def _validate_crds_first(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    sources = _crd_sources(index)
    for resource in index.resources:
        group = api_group(resource.resource_type)
        if group is None:
            continue
        kind = resource.resource_type.rsplit(":", 1)[-1]
        name = k8s_name(resource.props) or resource.name
        installers = sources.get(group, [])
        if not installers:
            report(f"{kind} {name!r}: nothing in this stack installs the CRDs of {group} (known sources: "
                   f"infra/charts.py CRD_SOURCES): on a fresh cluster the update fails with \"no matches for kind "
                   f"{kind}\"", resource.urn)
            continue
        waited = _closure(index, resource)
        if not any(i.urn in waited for i in installers):
            report(f"{kind} {name!r} does not depend on {', '.join(repr(i.name) for i in installers)}, which "
                   f"installs the CRDs of {group}: Pulumi may create it first (\"no matches for kind {kind}\")",
                   resource.urn)


def _node_pools(index: StackIndex, label: str = GPU_NODE_GROUP_LABEL) -> dict[str, list[PolicyResource]]:
    out: dict[str, list[PolicyResource]] = {}
    for pool in index.k8s("NodePool"):
        name = (get(pool.props, "spec", "template", "metadata", "labels") or {}).get(label)
        if name:
            out.setdefault(name, []).append(pool)
    return out


def _pool_types(pool: PolicyResource) -> list[str]:
    types: list[str] = []
    for req in as_list(get(pool.props, "spec", "template", "spec", "requirements")):
        if get(req, "key") == INSTANCE_TYPE_KEY and get(req, "operator") == "In":
            types += [str(t) for t in as_list(get(req, "values"))]
    return types


def _gpus_of(types: Iterable[str]) -> int:
    known = [INSTANCE_FACTS[t].gpus for t in types if t in INSTANCE_FACTS]
    return min(known) if known else 0


def _validate_autoscaled(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    ctx = stack_context(args)
    selected = {}
    for deployment in index.of_type(DEPLOYMENT):
        if is_serving_workload(deployment.props):
            chosen = pool_of(deployment.props)
            if chosen:
                selected.setdefault(chosen, deployment)
    if not selected:
        return
    cluster_autoscaler = any(str(get(r.props, "chart") or "").endswith(CLUSTER_AUTOSCALER_CHART)
                             for r in index.of_type(HELM_RELEASE))
    node_pools = {label: _node_pools(index, label) for label in (GPU_NODE_GROUP_LABEL, CPU_NODE_GROUP_LABEL)}
    approved_by_label = {GPU_NODE_GROUP_LABEL: APPROVED_INSTANCE_TYPES.get(ctx.env, frozenset()),
                         CPU_NODE_GROUP_LABEL: APPROVED_CPU_INSTANCE_TYPES.get(ctx.env, frozenset())}
    models = model_configs(ctx)
    for (label, pool), deployment in sorted(selected.items()):
        kind = "GPU" if label == GPU_NODE_GROUP_LABEL else "CPU"
        pools = node_pools[label].get(pool, [])
        approved = approved_by_label[label]
        if not pools and not cluster_autoscaler:
            report(f"{kind} pool {pool!r} (model server {k8s_name(deployment.props)!r}) has no node autoscaler: no "
                   f"Karpenter NodePool labels its nodes {label}={pool} and no Cluster Autoscaler "
                   f"runs, so red-black's surge pod and KEDA's extra replicas wait for nodes nobody adds",
                   deployment.urn)
            continue
        for node_pool in pools:
            bad = [t for t in _pool_types(node_pool) if t not in approved]
            if bad or not _pool_types(node_pool):
                report(f"NodePool {k8s_name(node_pool.props)!r}: instance types {bad or 'unrestricted'} not approved "
                       f"for {ctx.env} (approved: {', '.join(sorted(approved))})", node_pool.urn)
        if label != GPU_NODE_GROUP_LABEL:
            continue  # a CPU pool's reach: its NodePool's cpu limit and its group's maxSize (no GPU count)
        # Peak GPUs of the models on this pool against what its node groups and NodePools can reach.
        peak = 0
        for model in models.values():
            if model.gpu is None or model.gpu.node_group != pool:
                continue
            top = max(model.replicas, model.autoscaling.max_replicas if model.autoscaling else 0)
            copies = top + 1 if model.strategy == "red-black" else top * len(model.versions)
            peak += copies * model.gpu.count
        capacity = 0
        for group in index.of_type(NODE_GROUP):
            if (get(group.props, "labels") or {}).get(GPU_NODE_GROUP_LABEL) == pool:
                desired = get(group.props, "scalingConfig", "desiredSize") or 0
                capacity += int(desired) * _gpus_of(str(t) for t in as_list(get(group.props, "instanceTypes")))
        for node_pool in pools:
            limit = get(node_pool.props, "spec", "limits", "nvidia.com/gpu")
            capacity += int(float(limit)) if limit is not None else 10**6
        if cluster_autoscaler and not pools:
            continue  # the Cluster Autoscaler's reach is the node groups' maxSize, reviewed by gpu-nodes-size-cap
        if peak > capacity:
            report(f"GPU pool {pool!r}: its models need {peak} GPUs at their peak (KEDA's maxReplicas, plus "
                   f"red-black's surge pod), but its node groups and NodePools reach {capacity}", deployment.urn)


WAIT_FOR = "pulumi.com/waitFor"
ROUTE_KINDS = ("HTTPRoute", "GRPCRoute")
ROUTE_CONDITIONS = ("Accepted", "ResolvedRefs")


def _wait_for(resource: PolicyResource) -> list[str]:
    value = annotations(resource.props).get(WAIT_FOR)
    if not value:
        return []
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return [str(v) for v in as_list(parsed)]


def _waits_for_condition(waits: list[str], condition: str, on_parents: bool) -> bool:
    for w in waits:
        if w.replace(" ", "") == f"condition={condition}" and not on_parents:
            return True
        if w.startswith("jsonpath=") and f'"{condition}"' in w and w.replace(" ", "").endswith("=True") and (
                ".status.parents" in w or not on_parents):
            return True
    return False


def _validate_routes_wait(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for kind in ROUTE_KINDS:
        for route in index.k8s(kind):
            waits = _wait_for(route)
            missing = [c for c in ROUTE_CONDITIONS if not _waits_for_condition(waits, c, on_parents=True)]
            if missing:
                report(f"{kind} {k8s_name(route.props)!r}: Pulumi does not wait for the gateway controller to set "
                       f"{' and '.join(missing)} on the route's status.parents (annotation {WAIT_FOR} "
                       f"{waits or 'unset'}), so what depends on the route (the old version's scale-down) may run "
                       f"before the new weights are programmed", route.urn)
    for gateway in index.k8s("Gateway"):
        if not _waits_for_condition(_wait_for(gateway), "Programmed", on_parents=False):
            report(f"Gateway {k8s_name(gateway.props)!r}: Pulumi does not wait for its controller to program it "
                   f"({WAIT_FOR} condition=Programmed)", gateway.urn)


routes_wait_for_controller = StackValidationPolicy(
    name="routes-wait-for-controller",
    description="Routes and the Gateway carry a pulumi.com/waitFor on the controller's conditions (Accepted and "
                "ResolvedRefs; Programmed), so nothing that depends on them runs before they are programmed.",
    validate=_validate_routes_wait,
    enforcement_level=EnforcementLevel.MANDATORY,
)

crds_before_custom_resources = StackValidationPolicy(
    name="crds-before-custom-resources",
    description="Every custom resource's CRD is installed by the stack, and the custom resource depends on it.",
    validate=_validate_crds_first,
    enforcement_level=EnforcementLevel.MANDATORY,
)
gpu_capacity_autoscaled = StackValidationPolicy(
    name="gpu-capacity-autoscaled",
    description="Every GPU pool with model servers has a node autoscaler with approved types and GPUs for the "
                "models' peak (surge and KEDA maximum).",
    validate=_validate_autoscaled,
    enforcement_level=EnforcementLevel.MANDATORY,
)

POLICIES = [crds_before_custom_resources, gpu_capacity_autoscaled, routes_wait_for_controller]
