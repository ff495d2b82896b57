"""Experiments (A/B tests) point only at what the stack serves (docs/clients.md, "Experiments").

The schema (infra.config.ExperimentConfig, StackConfig) refuses allocations that do not sum to 100 and arms that name
a model or version absent from the stack file. This policy states those rules again for `pulumi preview` against a
config edited by hand, and adds what only the resources show: every arm's version has a Deployment with replicas and
a route that sends it traffic. A version being removed (its Deployment gone or scaled to zero, or its route at
weight 0) would leave that arm's users without answers, so the stack is refused until the experiment moves off it.
"""

from __future__ import annotations

from pulumi_policy import EnforcementLevel, ReportViolation, StackValidationArgs, StackValidationPolicy
from pydantic import ValidationError

from infra.config import ExperimentConfig, experiment_problems

from .._props import as_number, get, iter_mappings, k8s_namespace, labels
from ..context import PolicyContextError, stack_context
from ..index import StackIndex, is_serving_workload, selector_matches
from ..models import model_configs
from ..workload import DEPLOYMENT, model_identity, pod_template, replicas

ROUTE_KINDS = ("HTTPRoute", "GRPCRoute")


def _routed(index: StackIndex) -> set[tuple[str | None, str | None]]:
    """(model id, version) of every Deployment with replicas that some route sends a weight > 0 to."""
    found = set()
    for route in (r for kind in ROUTE_KINDS for r in index.k8s(kind)):
        namespace = k8s_namespace(route.props)
        for rule in iter_mappings(get(route.props, "spec", "rules")):
            for ref in iter_mappings(rule.get("backendRefs")):
                weight = as_number(ref.get("weight"))
                if weight == 0 or (ref.get("kind") or "Service") != "Service":
                    continue  # Gateway API: weight defaults to 1
                service = index.k8s_named("Service", ref.get("namespace") or namespace, str(ref.get("name")))
                if service is None:
                    continue
                selector = get(service.props, "spec", "selector")
                for dep in index.of_type(DEPLOYMENT):
                    if (k8s_namespace(dep.props) == k8s_namespace(service.props) and replicas(dep.props) > 0
                            and selector_matches(selector, labels(pod_template(dep.props)))):
                        found.add(model_identity(dep.props))
    return found


def _validate_experiments(args: StackValidationArgs, report: ReportViolation) -> None:
    ctx = stack_context(args)
    raw = ctx.config.get("experiments") or []
    if not raw:
        return
    try:
        models = model_configs(ctx)
    except PolicyContextError as err:
        report(str(err), None)
        return
    index = StackIndex(args.resources)
    routed = _routed(index)
    deployed = {model_identity(d.props) for d in index.of_type(DEPLOYMENT) if is_serving_workload(d.props)}
    for i, entry in enumerate(raw if isinstance(raw, list) else [raw]):
        where = f"stack {ctx.stack!r}: llm-serving:experiments[{i}]"
        try:
            experiment = ExperimentConfig.model_validate(entry)
        except ValidationError as err:
            first = err.errors()[0]
            report(f"{where}.{'.'.join(map(str, first['loc']))}: {first['msg'].removeprefix('Value error, ')}"
                   if first["loc"] else f"{where}: {first['msg'].removeprefix('Value error, ')}", None)
            continue
        where = f"{where} ({experiment.name})"
        for j, key, message in experiment_problems(experiment, models):
            report(f"{where}.arms[{j}].{key}: {message}", None)
        for j, arm in enumerate(experiment.arms):
            if arm.model not in models or arm.percent == 0:
                continue
            versions = [arm.version] if arm.version else [v.version for v in models[arm.model].versions]
            live = [v for v in versions if (arm.model, v) in routed]
            if not live:
                state = "has no Deployment" if not any((arm.model, v) in deployed for v in versions) else (
                    "has no replicas or no route that sends it traffic")
                report(f"{where}.arms[{j}] ({arm.name}, {arm.percent:g}%): {arm.model} "
                       f"{arm.version or 'any version'} {state} in this stack, so the arm's units would get no "
                       f"answer; move the experiment off a version being removed first", None)


experiments_arms_served = StackValidationPolicy(
    name="experiments-arms-served",
    description="Every experiment's allocations sum to 100 and each arm's model version is served with traffic.",
    validate=_validate_experiments,
    enforcement_level=EnforcementLevel.MANDATORY,
)

POLICIES = [experiments_arms_served]
