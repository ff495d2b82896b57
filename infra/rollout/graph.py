"""A model's serving resources and their ordering, built straight from its config without running the program.

This mirrors `infra.serving` (same names, labels, replicas, route weights, and the dependencies that order a
red-black step) so that property tests can drive thousands of updates through the simulator; running the
real program under the mock runtime takes seconds per update. `tests/infra/test_rollout_graph.py` keeps the two
honest: on the shipped stacks and on edited copies, this graph equals the real program's graph restricted to these
resources (their inputs' replicas and weights, and the transitive dependencies between them).
"""

from __future__ import annotations

from infra.config import ModelConfig
from infra.naming import instance_name, model_labels
from infra.rollout.planner import plan_red_black
from infra.rollout.simulator import DEPLOYMENT, ROUTE_TYPES, SERVICE, Node

HTTP_ROUTE, GRPC_ROUTE = ROUTE_TYPES


def _deployment(model: ModelConfig, version: str, replicas: int, deps: list[str] = ()) -> Node:
    name = instance_name(model.id, version)
    return Node(DEPLOYMENT, f"{name}-deployment",
                {"metadata": {"name": name, "labels": model_labels(model.id, version)},
                 "spec": {"replicas": replicas}}, frozenset(deps))


def _service(model: ModelConfig, version: str) -> Node:
    name = instance_name(model.id, version)
    return Node(SERVICE, f"{name}-service", {"metadata": {"name": name, "labels": model_labels(model.id, version)}})


def _routes(model: ModelConfig, name: str, label_version: str, backends: list[tuple[str, int]],
            deps: list[Node]) -> list[Node]:
    refs = [{"name": svc, "weight": weight} for svc, weight in backends]
    return [Node(kind, f"{name}-{suffix}",
                 {"metadata": {"name": f"{name}-{suffix}", "labels": model_labels(model.id, label_version)},
                  "spec": {"rules": [{"backendRefs": refs}]}}, frozenset(d.key for d in deps))
            for kind, suffix in ((HTTP_ROUTE, "http"), (GRPC_ROUTE, "grpc"))]


def model_graph(model: ModelConfig) -> list[Node]:
    if model.strategy == "versioned":
        nodes: list[Node] = []
        for v in model.versions:
            dep, svc = _deployment(model, v.version, model.replicas), _service(model, v.version)
            name = instance_name(model.id, v.version)
            nodes += [dep, svc, *_routes(model, name, v.version, [(name, 100)], [dep, svc])]
        return nodes
    plan = plan_red_black(model.active, model.replicas, model.candidate, model.weight,
                          model.autoscaling.max_replicas if model.autoscaling else None)
    active = plan.active.version
    if plan.candidate is None:
        dep, svc = _deployment(model, active, plan.active.replicas), _service(model, active)
        return [dep, svc, *_routes(model, model.id, active, [(instance_name(model.id, active), 100)], [dep, svc])]
    cand = plan.candidate.version
    cand_dep, cand_svc = _deployment(model, cand, plan.candidate.replicas), _service(model, cand)
    routes = _routes(model, model.id, active, [(instance_name(model.id, s.version), s.weight) for s in plan.shares],
                     [cand_dep, cand_svc])
    active_dep = _deployment(model, active, plan.active.replicas, [r.key for r in routes])
    return [cand_dep, cand_svc, *routes, active_dep, _service(model, active)]
