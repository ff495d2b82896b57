"""Rollouts as stack updates (docs/architecture.md §4): the strategy fits the interface change, traffic goes only to
versions that have replicas (and only after Pulumi has waited for them), and the active version (a versioned model's
newest, a red-black model's version with the traffic: infra.config.active_version) is never removed.

The model list comes from the stack's config (`llm-serving:models`, typed by the program's schema); what is really
deployed comes from the Deployments (§3.10 labels name and version), Services and Gateway API routes.
"""

from __future__ import annotations

from collections import defaultdict

from pulumi_policy import EnforcementLevel, PolicyResource, ReportViolation, StackValidationArgs, StackValidationPolicy

from .._props import as_number, get, iter_mappings, k8s_namespace, labels
from ..context import PolicyContextError, stack_context
from ..index import StackIndex, is_serving_workload, selector_matches
from ..models import active_version, model_configs
from ..workload import DEPLOYMENT, model_identity, pod_template, replicas

ROUTE_KINDS = ("HTTPRoute", "GRPCRoute")


def _models(args: StackValidationArgs, report: ReportViolation):
    try:
        return model_configs(stack_context(args))
    except PolicyContextError as err:
        report(str(err), None)
        return None


def _validate_strategy(args: StackValidationArgs, report: ReportViolation) -> None:
    models = _models(args, report)
    for model in (models or {}).values():
        if model.strategy == "versioned":
            by_fp: dict[str, list[str]] = defaultdict(list)
            for v in model.versions:
                by_fp[v.io_fingerprint].append(v.version)
            for fingerprint, versions in by_fp.items():
                if len(versions) > 1:
                    report(
                        f"model {model.id!r} is versioned but versions {', '.join(versions)} share the I/O "
                        f"fingerprint {fingerprint[:19]}...: versioned is only for an I/O schema change; roll "
                        f"versions with the same interface out red-black",
                        None,
                    )
        elif model.candidate is not None:
            active, candidate = model.version(model.active), model.version(model.candidate)
            if active.io_fingerprint != candidate.io_fingerprint:
                report(
                    f"model {model.id!r} rolls {model.candidate} out red-black over {model.active}, but their I/O "
                    f"fingerprints differ ({active.io_fingerprint[:19]}... vs {candidate.io_fingerprint[:19]}...): "
                    f"clients would get two interfaces behind one route; use strategy: versioned",
                    None,
                )


def _backends(index: StackIndex, service: PolicyResource) -> list[PolicyResource]:
    selector = get(service.props, "spec", "selector")
    namespace = k8s_namespace(service.props)
    return [
        d
        for d in index.of_type(DEPLOYMENT)
        if k8s_namespace(d.props) == namespace and selector_matches(selector, labels(pod_template(d.props)))
    ]


def _routes(index: StackIndex) -> list[PolicyResource]:
    return [r for kind in ROUTE_KINDS for r in index.k8s(kind)]


def _autoscaler_floors(index: StackIndex, dep: PolicyResource) -> list[tuple[PolicyResource, float]]:
    """(autoscaler, the fewest replicas it may leave) for every KEDA ScaledObject or HPA that targets `dep`."""
    name, namespace = get(dep.props, "metadata", "name"), k8s_namespace(dep.props)
    found = []
    for kind, key, default in (("ScaledObject", "minReplicaCount", 0.0), ("HorizontalPodAutoscaler", "minReplicas",
                                                                          1.0)):
        for scaler in index.k8s(kind):
            target = get(scaler.props, "spec", "scaleTargetRef") or {}
            if (
                k8s_namespace(scaler.props) == namespace
                and target.get("name") == name
                and (target.get("kind") or "Deployment") == "Deployment"
            ):
                floor = as_number(get(scaler.props, "spec", key))
                # KEDA's minReplicaCount defaults to 0 (scale to zero), an HPA's minReplicas to 1.
                found.append((scaler, default if floor is None else floor))
    return found


def _ordered_safely(index: StackIndex, route: PolicyResource, dep: PolicyResource, actives: set) -> bool:
    """Traffic may reach `dep` through `route` only once Pulumi has waited for `dep` to be ready: the route depends
    on it. The one exception is a red-black model's active version, which §4 scales down after the route changes
    (so it depends on the route instead); it was serving before the update began."""
    if index.depends_on(route, dep):
        return True
    return index.depends_on(dep, route) and model_identity(dep.props) in actives


def _validate_weights(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    models = _models(args, report) or {}
    actives = {(m.id, m.active) for m in models.values() if m.strategy == "red-black"}
    for route in _routes(index):
        namespace = k8s_namespace(route.props)
        for i, rule in enumerate(iter_mappings(get(route.props, "spec", "rules"))):
            refs = list(iter_mappings(rule.get("backendRefs")))
            weights = [as_number(ref.get("weight")) for ref in refs]
            weights = [1.0 if w is None else w for w in weights]  # Gateway API: weight defaults to 1
            if refs and not any(weights):
                report(f"route {route.name!r} rule #{i}: every backend has weight 0, so the route drops all its "
                       f"traffic", route.urn)
            for ref, weight in zip(refs, weights, strict=True):
                if not weight:
                    continue
                target = f"route {route.name!r} rule #{i} sends weight {weight:g} to {ref.get('name')!r}"
                if (ref.get("kind") or "Service") != "Service":
                    continue
                service = index.k8s_named("Service", ref.get("namespace") or namespace, str(ref.get("name")))
                if service is None:
                    report(f"{target}, which is not a Service of this stack: its replicas cannot be checked",
                           route.urn)
                    continue
                deployments = _backends(index, service)
                if not deployments:
                    report(f"{target}, a Service that selects no Deployment of this stack", route.urn)
                    continue
                if sum(replicas(d.props) for d in deployments) <= 0:
                    names = ", ".join(d.name for d in deployments)
                    report(f"{target}, whose Deployment(s) {names} have 0 replicas", route.urn)
                for dep in deployments:
                    for scaler, floor in _autoscaler_floors(index, dep):
                        if floor <= 0:
                            report(f"{target}, but {scaler.name!r} may scale Deployment {dep.name!r} to zero "
                                   f"(minimum {floor:g}) while it holds that weight", route.urn)
                for dep in deployments:
                    if replicas(dep.props) > 0 and not _ordered_safely(index, route, dep, actives):
                        report(
                            f"{target} without depending on Deployment {dep.name!r}: Pulumi could move traffic "
                            f"before that version is ready; add it to the route's dependsOn",
                            route.urn,
                        )


def _served(index: StackIndex, model_id: str, version: str) -> list[PolicyResource]:
    return [
        d
        for d in index.of_type(DEPLOYMENT)
        if is_serving_workload(d.props) and model_identity(d.props) == (model_id, version)
    ]


def _validate_newest(args: StackValidationArgs, report: ReportViolation) -> None:
    models = _models(args, report)
    if not models:
        return
    index = StackIndex(args.resources)
    routes = _routes(index)
    for model in models.values():
        # The same version the stack outputs name as activeVersion. A red-black model's is the one with the traffic,
        # whatever its number: a rollout back to a lower version removes the higher one at its last step.
        newest = active_version(model)
        deployments = [d for d in _served(index, model.id, newest) if replicas(d.props) > 0]
        if not deployments:
            what = "newest version" if model.strategy == "versioned" else "active version (all of its traffic)"
            report(f"model {model.id!r}: its {what} {newest!r} has no Deployment with replicas in this "
                   f"stack; the {what.split(' (')[0]} is never removed or scaled to zero", None)
            continue
        if model.strategy != "versioned":
            continue
        # Versioned: the newest version also keeps its own Service and route (§4).
        services = [s for s in index.k8s("Service") if any(d in _backends(index, s) for d in deployments)]
        names = {(k8s_namespace(s.props), get(s.props, "metadata", "name")) for s in services}
        routed = any(
            (ref.get("namespace") or k8s_namespace(r.props), ref.get("name")) in names
            for r in routes
            for rule in iter_mappings(get(r.props, "spec", "rules"))
            for ref in iter_mappings(rule.get("backendRefs"))
        )
        if not services or not routed:
            missing = "Service" if not services else "route"
            report(f"model {model.id!r}: its newest version {newest!r} has no {missing} of its own; a versioned "
                   f"model keeps a Deployment, Service and route per version", None)


def _validate_surge(args: StackValidationArgs, report: ReportViolation) -> None:
    models = _models(args, report)
    if not models:
        return
    index = StackIndex(args.resources)
    for model in models.values():
        if model.strategy != "red-black":
            continue  # versioned models overlap on purpose; the rollout tool reports that cost
        deployments = [
            d for d in index.of_type(DEPLOYMENT) if is_serving_workload(d.props) and model_identity(d.props)[0] ==
            model.id
        ]
        total = sum(replicas(d.props) for d in deployments)
        if total > model.replicas + 1:
            shown = ", ".join(f"{d.name}={replicas(d.props):g}" for d in deployments)
            report(f"model {model.id!r} runs {total:g} replicas ({shown}) for replicas: {model.replicas}: a red-black "
                   f"step may add at most one replica of surge (§4), never a second full copy of its GPUs", None)


rollout_strategy_fits_io = StackValidationPolicy(
    name="rollout-versioned-only-on-io-change",
    description="A model is versioned only when the I/O fingerprint changes between versions; red-black otherwise.",
    validate=_validate_strategy,
    enforcement_level=EnforcementLevel.MANDATORY,
)
rollout_weight_to_replicas = StackValidationPolicy(
    name="rollout-weight-only-to-replicas",
    description="Routes send weight only to versions with replicas, and only after Pulumi has waited for them.",
    validate=_validate_weights,
    enforcement_level=EnforcementLevel.MANDATORY,
)
rollout_newest_kept = StackValidationPolicy(
    name="rollout-newest-version-kept",
    description="Every model's active version (versioned: the newest) stays deployed with replicas (and, when "
                "versioned, its own route).",
    validate=_validate_newest,
    enforcement_level=EnforcementLevel.MANDATORY,
)

rollout_gpu_surge = StackValidationPolicy(
    name="rollout-gpu-surge-bound",
    description="A red-black model runs at most its replicas plus one during a rollout.",
    validate=_validate_surge,
    enforcement_level=EnforcementLevel.MANDATORY,
)

POLICIES = [rollout_strategy_fits_io, rollout_weight_to_replicas, rollout_newest_kept, rollout_gpu_surge]
