"""What `pulumi up` and Kubernetes do with a stack's resource graph, simulated for the mock runner and the tests.

There is no Pulumi engine, provider or cluster here (docs/local-environment.md, "Pulumi offline"), so this module
plays their part on the graph the program really registers (infra.mockrun records every resource with its inputs
and its dependencies):

- a step per resource that is new or whose inputs changed; a step starts only when the steps of everything it
  depends on have finished (Pulumi's rule); among the steps that may start, scale-ups go first and scale-downs last,
  the worst order a parallel engine could pick for the GPU count;
- a Deployment step waits for its pods to be ready (the Kubernetes provider's await logic); a version injected as
  "never ready" fails that step, and the update stops there: nothing that depends on it runs, nothing is deleted
  (a failed `pulumi up` is not rolled back by Pulumi);
- resources the program no longer registers are deleted after every other step, dependents first.

After every step the observer sees the live state, so the tests can check invariants at every intermediate moment,
not only between updates. What is simulated is stated here and in docs/rollouts.md; the graph, the inputs and the
dependencies are the real program's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

DEPLOYMENT = "kubernetes:apps/v1:Deployment"
SERVICE = "kubernetes:core/v1:Service"
ROUTE_TYPES = ("kubernetes:gateway.networking.k8s.io/v1:HTTPRoute", "kubernetes:gateway.networking.k8s.io/v1:GRPCRoute")
NAME_LABEL = "app.kubernetes.io/name"
VERSION_LABEL = "app.kubernetes.io/version"


@dataclass(frozen=True)
class Node:
    """One resource the program registers: `key` is "<type>::<name>" (unique per stack), `deps` are keys."""

    type: str
    name: str
    inputs: dict
    deps: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return f"{self.type}::{self.name}"


@dataclass
class LiveResource:
    type: str
    name: str
    inputs: dict
    ready: int = 0  # ready pods, for Deployments

    def to_json(self) -> dict:
        return {"type": self.type, "name": self.name, "inputs": self.inputs, "ready": self.ready}


Live = dict[str, LiveResource]


@dataclass(frozen=True)
class Faults:
    """Injected failures for one stack: (model id, version) pairs whose pods never become ready."""

    never_ready: frozenset[tuple[str, str]] = frozenset()


@dataclass
class UpdateOutcome:
    ok: bool
    steps: list[str] = field(default_factory=list)  # "create|update|delete <key>", in the order they ran
    failed: str | None = None  # the key whose step failed
    message: str = ""


class UpdateError(RuntimeError):
    pass


class Cluster(Protocol):
    """What carries out each step of an update (the Kubernetes provider and the cluster behind it).

    `apply_update` decides the order (Pulumi's) and calls these one at a time: `apply` creates or updates one
    resource and, for a Deployment, waits as the provider's await logic does and returns how many of its pods are
    ready (the step failed when fewer than its replicas); `delete` removes one resource the program no longer
    registers. `SimulatedCluster` plays them on the recorded state; the rehearsal's cluster (llm_serving_cli/
    rehearsal/cluster.py, reached through infra.rollout.runner.RehearsalRunner) runs real pods and a real proxy."""

    def apply(self, node: Node, previous: LiveResource | None) -> int: ...

    def delete(self, resource: LiveResource) -> None: ...


@dataclass(frozen=True)
class SimulatedCluster:
    """Every pod becomes ready at once, except those of the (model id, version) pairs `faults` names."""

    faults: Faults = Faults()

    def apply(self, node: Node, previous: LiveResource | None) -> int:
        if node.type != DEPLOYMENT:
            return 0
        want = _replicas(node.inputs)
        if identity(node) in self.faults.never_ready and want > 0:
            # The new pods never pass their readiness probe; pods of this version that were ready stay ready.
            return min(previous.ready, want) if previous is not None else 0
        return want

    def delete(self, resource: LiveResource) -> None:
        return None


def _replicas(inputs: dict) -> int:
    value = (inputs.get("spec") or {}).get("replicas")
    return int(value) if value is not None else 1


def _labels(inputs: dict) -> dict:
    return (inputs.get("metadata") or {}).get("labels") or {}


def identity(res: LiveResource | Node) -> tuple[str, str] | None:
    labels = _labels(res.inputs)
    if NAME_LABEL in labels and VERSION_LABEL in labels:
        return str(labels[NAME_LABEL]), str(labels[VERSION_LABEL])
    return None


def _k8s_name(inputs: dict) -> str | None:
    return (inputs.get("metadata") or {}).get("name")


def _scale(live: Live, node: Node) -> int:
    """+1 for a Deployment step that adds replicas, -1 for one that removes them, 0 otherwise."""
    if node.type != DEPLOYMENT:
        return 0
    before = _replicas(live[node.key].inputs) if node.key in live else 0
    after = _replicas(node.inputs)
    return (after > before) - (after < before)


def apply_update(live: Live, desired: Iterable[Node], faults: Faults = Faults(),
                 observe: Callable[[Live, str], None] | None = None, cluster: Cluster | None = None) -> UpdateOutcome:
    """Bring `live` (changed in place) toward `desired` as `pulumi up` would; see the module docstring. Each step is
    carried out by `cluster` (default: SimulatedCluster(faults))."""
    cluster = cluster if cluster is not None else SimulatedCluster(faults)
    nodes = {n.key: n for n in desired}
    for node in nodes.values():
        missing = sorted(d for d in node.deps if d not in nodes)
        if missing:
            raise UpdateError(f"{node.key} depends on resources the program did not register: {missing}")
    # A Deployment whose last step failed keeps its "initialization error" and is retried, as Pulumi does.
    pending = {k for k, n in nodes.items()
               if k not in live or live[k].inputs != n.inputs
               or (n.type == DEPLOYMENT and live[k].ready < _replicas(live[k].inputs))}
    done = set(nodes) - pending
    outcome = UpdateOutcome(ok=True)
    while pending:
        runnable = [k for k in pending if nodes[k].deps <= done]
        if not runnable:
            raise UpdateError(f"dependency cycle among {sorted(pending)}")
        key = min(runnable, key=lambda k: (-_scale(live, nodes[k]), k))
        node = nodes[key]
        verb = "create" if key not in live else "update"
        ready = cluster.apply(node, live.get(key))
        failed = node.type == DEPLOYMENT and ready < _replicas(node.inputs)
        live[key] = LiveResource(node.type, node.name, node.inputs, ready)
        pending.discard(key)
        outcome.steps.append(f"{verb} {key}")
        if observe:
            observe(live, f"{verb} {key}")
        if failed:
            outcome.ok, outcome.failed = False, key
            outcome.message = (f"{node.name}: Deployment did not become ready ({ready}/{_replicas(node.inputs)} pods "
                               f"ready) before its timeout; the update stopped, {len(pending)} step(s) not run")
            return outcome
        done.add(key)
    # Deletes last, as Pulumi does, dependents first: routes, then Services and the rest, then Deployments (the
    # live state keeps no dependency list; among the serving resources this is the order their dependencies give).
    doomed = [k for k in live if k not in nodes]
    order = sorted(doomed, key=lambda k: (0 if live[k].type in ROUTE_TYPES else 1 if live[k].type != DEPLOYMENT
                                          else 2, k))
    for key in order:
        cluster.delete(live[key])
        del live[key]
        outcome.steps.append(f"delete {key}")
        if observe:
            observe(live, f"delete {key}")
    return outcome


def converge(desired: Iterable[Node]) -> Live:
    """The live state of a stack that was deployed from `desired` and is healthy (the starting point)."""
    live: Live = {}
    outcome = apply_update(live, desired)
    if not outcome.ok:  # cannot happen without faults; kept loud in case apply_update changes
        raise UpdateError(f"converging a healthy stack failed: {outcome.message}")
    return live


# -- reading the live state ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    route: str
    service: str
    version: str | None
    weight: int
    ready: int  # ready pods behind the Service


def backends(live: Live, model_id: str) -> list[Backend]:
    """Every weighted backend of every route of `model_id`, with the ready pods of the Deployment behind it."""
    deployments = {_k8s_name(r.inputs): r for r in live.values() if r.type == DEPLOYMENT}
    services = {_k8s_name(r.inputs): r for r in live.values() if r.type == SERVICE}
    out = []
    for route in live.values():
        if route.type not in ROUTE_TYPES or _labels(route.inputs).get(NAME_LABEL) != model_id:
            continue
        for rule in (route.inputs.get("spec") or {}).get("rules") or []:
            for ref in rule.get("backendRefs") or []:
                name = ref.get("name")
                service = services.get(name)
                dep = deployments.get(name)
                version = identity(service)[1] if service is not None and identity(service) else None
                out.append(Backend(route.name, name, version, int(ref.get("weight", 1)),
                                   dep.ready if dep is not None and service is not None else 0))
    return out


def route_weights(live: Live, model_id: str) -> dict[str, dict[str, int]]:
    """route name -> version -> weight (the first rule's; every rule of a route carries the same weights)."""
    out: dict[str, dict[str, int]] = {}
    seen: set[tuple[str, str]] = set()
    for b in backends(live, model_id):
        if (b.route, b.service) in seen:
            continue
        seen.add((b.route, b.service))
        out.setdefault(b.route, {})[b.version or b.service] = b.weight
    return out


def model_replicas(live: Live, model_id: str) -> dict[str, int]:
    """version -> replicas of `model_id`'s Deployments."""
    out = {}
    for res in live.values():
        ident = identity(res)
        if res.type == DEPLOYMENT and ident and ident[0] == model_id:
            out[ident[1]] = _replicas(res.inputs)
    return out


def ready_replicas(live: Live, model_id: str) -> dict[str, int]:
    out = {}
    for res in live.values():
        ident = identity(res)
        if res.type == DEPLOYMENT and ident and ident[0] == model_id:
            out[ident[1]] = res.ready
    return out


def traffic_to_unready(live: Live, model_id: str) -> list[Backend]:
    """Backends that get traffic although no pod behind them is ready (what §4 forbids)."""
    return [b for b in backends(live, model_id) if b.weight > 0 and b.ready <= 0]


def live_from_json(doc: dict[str, Any]) -> Live:
    return {k: LiveResource(**v) for k, v in doc.items()}


def live_to_json(live: Live) -> dict[str, Any]:
    return {k: v.to_json() for k, v in live.items()}
