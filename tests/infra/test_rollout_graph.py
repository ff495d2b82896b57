"""The shipped stacks show both rollout shapes under the mock runtime, and the fast graph that the property tests
drive (infra.rollout.graph) is the real program's graph: same Deployments, replicas, route weights and ordering.

Runs the real program (infra/__main__.py) under Pulumi's mock runtime: on prod-us-east-1 (a red-black rollout at
25%), prod-us-west-2 (a versioned model with two versions) and an edited copy of prod-us-east-1 (candidate at 100%,
the moment before finalizing).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from infra.mockrun import run_stack, stack_config_path
from infra.rollout import simulator
from infra.rollout.graph import model_graph
from infra.rollout.runner import nodes_of_run
from infra.rollout.stackfile import StackFile
from tests.infra.rollout_support import copy_stacks

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    edited = copy_stacks(tmp_path_factory.mktemp("stacks"))
    sf = StackFile.load(edited / "Pulumi.prod-us-east-1.yaml")
    sf.set_weight("chat-large", 100)
    sf.save()
    jobs = {"east": ("prod-us-east-1", None), "west": ("prod-us-west-2", None),
            "east-100": ("prod-us-east-1", edited / "Pulumi.prod-us-east-1.yaml")}
    with ThreadPoolExecutor(3) as pool:
        futures = {k: pool.submit(run_stack, stack, config_file=path) for k, (stack, path) in jobs.items()}
        return {k: f.result() for k, f in futures.items()}, edited


def test_shipped_red_black_rollout_in_progress(runs):
    run = runs[0]["east"]
    weights = run.outputs["models"]["chat-large"]["routeWeights"]
    assert weights == {"2.3.0": 75, "2.4.0": 25} and 0 < weights["2.4.0"] < 100
    live = simulator.converge(nodes_of_run(run))
    assert simulator.route_weights(live, "chat-large") == {"chat-large-http": weights, "chat-large-grpc": weights}
    assert simulator.model_replicas(live, "chat-large") == {"2.3.0": 3, "2.4.0": 1}  # 4 replicas + 1 of surge


def test_shipped_versioned_model_with_two_versions(runs):
    run = runs[0]["west"]
    ranker = run.outputs["models"]["ranker"]
    assert ranker["strategy"] == "versioned" and ranker["versions"] == ["3.0.0", "4.0.0"]
    live = simulator.converge(nodes_of_run(run))
    # each version: its own Deployment (all replicas), Service and routes, each route all on its own version
    assert simulator.model_replicas(live, "ranker") == {"3.0.0": 2, "4.0.0": 2}
    assert simulator.route_weights(live, "ranker") == {
        "ranker-3-0-0-http": {"3.0.0": 100}, "ranker-3-0-0-grpc": {"3.0.0": 100},
        "ranker-4-0-0-http": {"4.0.0": 100}, "ranker-4-0-0-grpc": {"4.0.0": 100}}
    assert set(ranker["versionEndpoints"]) == {"3.0.0", "4.0.0"}


def _closure(nodes: list[simulator.Node]) -> dict[str, set[str]]:
    by_key = {n.key: n for n in nodes}
    memo: dict[str, set[str]] = {}

    def reach(key: str) -> set[str]:
        if key not in memo:
            memo[key] = set()
            for dep in by_key[key].deps:
                memo[key] |= {dep} | reach(dep)
        return memo[key]

    return {k: reach(k) for k in by_key}


def _serving(nodes: list[simulator.Node], model_id: str) -> list[simulator.Node]:
    types = (simulator.DEPLOYMENT, simulator.SERVICE, *simulator.ROUTE_TYPES)
    return [n for n in nodes if n.type in types and simulator.identity(n) and simulator.identity(n)[0] == model_id]


@pytest.mark.parametrize("key, stack, model_id", [
    ("east", "prod-us-east-1", "chat-large"),  # candidate at 25%
    ("east", "prod-us-east-1", "embed-base"),  # red-black at rest
    ("west", "prod-us-west-2", "ranker"),  # versioned, two versions
    ("east-100", "prod-us-east-1", "chat-large"),  # candidate at 100%: the active has 0 replicas
])
def test_fast_graph_is_the_programs_graph(runs, key, stack, model_id):
    done, edited = runs
    real = nodes_of_run(done[key])
    path = edited / f"Pulumi.{stack}.yaml" if key == "east-100" else stack_config_path(stack)
    model = StackFile.load(path).model(model_id)
    fast = model_graph(model)
    real_serving = _serving(real, model_id)
    assert sorted(n.key for n in fast) == sorted(n.key for n in real_serving)
    real_by_key = {n.key: n for n in real_serving}
    for node in fast:
        got = real_by_key[node.key].inputs
        assert got["metadata"]["name"] == node.inputs["metadata"]["name"]
        assert got["metadata"]["labels"] == node.inputs["metadata"]["labels"]
        if node.type == simulator.DEPLOYMENT:
            assert got["spec"]["replicas"] == node.inputs["spec"]["replicas"], node.key
        if node.type in simulator.ROUTE_TYPES:
            want = [(r["name"], r["weight"]) for r in node.inputs["spec"]["rules"][0]["backendRefs"]]
            for rule in got["spec"]["rules"]:
                assert [(r["name"], r["weight"]) for r in rule["backendRefs"]] == want, node.key
    # Ordering: among these resources, what depends on what (transitively, through anything in between) is the
    # same in both graphs, so the simulator orders the fast graph's steps as it orders the program's.
    real_reach, fast_reach = _closure(real), _closure(fast)
    keys = set(real_by_key)
    for k in keys:
        assert real_reach[k] & keys == fast_reach[k], k
