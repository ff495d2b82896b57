"""Red-black inside one update (docs/architecture.md §4) is ordered by resource dependencies: candidate Deployment
(Pulumi waits for it to be ready) -> route weights -> active scale-down. Checked on the dependency graph Pulumi's
real SDK builds for the program under the mock runtime (the engine walks exactly these edges in `pulumi up`)."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import yaml

from infra.mockrun import MockedResource, StackRun, run_stack, shipped_run, stack_config_path

STACK = "prod-us-east-1"  # chat-large is mid-rollout there: 2.3.0 active, 2.4.0 candidate at 25%


def depends_on(run: StackRun, a: MockedResource, b: MockedResource) -> bool:
    """True if `a` (transitively) depends on `b`, so Pulumi finishes `b` before it starts `a`."""
    by_urn, seen, todo = run.by_urn(), set(), list(a.dependencies)
    while todo:
        urn = todo.pop()
        if urn == b.urn:
            return True
        if urn in seen:
            continue
        seen.add(urn)
        dep = by_urn.get(urn)
        if dep is not None:
            todo.extend(dep.dependencies)
    return False


def parts(run: StackRun, model: str, version: str) -> dict[str, MockedResource]:
    inst = f"{model}-{version.replace('.', '-')}"
    out = {"deployment": run.find("kubernetes:apps/v1:Deployment", f"{inst}-deployment"),
           "service": run.find("kubernetes:core/v1:Service", f"{inst}-service")}
    scaled = [r for r in run.of_type("kubernetes:keda.sh/v1alpha1:ScaledObject") if r.name == f"{inst}-scaledobject"]
    if scaled:
        out["scaledobject"] = scaled[0]
    return out


def routes(run: StackRun, model: str) -> list[MockedResource]:
    return [run.find("kubernetes:gateway.networking.k8s.io/v1:HTTPRoute", f"{model}-http"),
            run.find("kubernetes:gateway.networking.k8s.io/v1:GRPCRoute", f"{model}-grpc")]


def models_config(stack: str = STACK) -> list[dict]:
    return yaml.safe_load(stack_config_path(stack).read_text())["config"]["llm-serving:models"]


def with_chat_large(**changes) -> list[dict]:
    models = copy.deepcopy(models_config())
    chat = next(m for m in models if m["id"] == "chat-large")
    for key, value in changes.items():
        if value is None:
            chat.pop(key, None)
        else:
            chat[key] = value
    if "versions" not in changes and chat.get("candidate") is None:
        chat["versions"] = [v for v in chat["versions"] if v["version"] == chat["active"]]
    return models


@functools.cache
def _run_cached(overrides: str) -> StackRun:
    return run_stack(STACK, json.loads(overrides))


def run_with(models: list[dict]) -> StackRun:
    return _run_cached(json.dumps({"models": models}, sort_keys=True))


def test_rollout_in_progress_orders_candidate_then_routes_then_active():
    run = shipped_run(STACK)
    candidate, active = parts(run, "chat-large", "2.4.0"), parts(run, "chat-large", "2.3.0")
    for route in routes(run, "chat-large"):
        # routes move only after the candidate is ready (Pulumi waits on the Deployment's readiness) ...
        assert depends_on(run, route, candidate["deployment"])
        assert depends_on(run, route, candidate["service"])
        # ... and the active version gives up replicas (Deployment and its autoscaler floor) only after that.
        assert depends_on(run, active["deployment"], route)
        assert depends_on(run, active["scaledobject"], route)
        assert not depends_on(run, candidate["deployment"], route)
    assert not depends_on(run, candidate["deployment"], active["deployment"])
    # Pulumi's default 10 minutes is too short for GPU starts: the candidate's wait is longer.
    assert int(candidate["deployment"].custom_timeouts["create"].rstrip("m")) > 10
    assert int(candidate["deployment"].custom_timeouts["update"].rstrip("m")) > 10


def test_rollout_in_progress_replicas_stay_within_one_step_of_surge():
    run = shipped_run(STACK)
    replicas = {d.inputs["metadata"]["labels"]["app.kubernetes.io/version"]: d.inputs["spec"]["replicas"]
                for d in run.of_type("kubernetes:apps/v1:Deployment")
                if d.inputs["metadata"]["labels"].get("app.kubernetes.io/name") == "chat-large"}
    assert replicas == {"2.3.0": 3, "2.4.0": 1}  # 4 replicas, 25%: one moves
    assert sum(replicas.values()) <= 4 + 1


def test_at_rest_the_active_version_comes_first_and_gets_all_traffic():
    run = run_with(with_chat_large(candidate=None, weight=None))
    active = parts(run, "chat-large", "2.3.0")
    assert not [r for r in run.of_type("kubernetes:apps/v1:Deployment") if "2-4-0" in r.name]
    for route in routes(run, "chat-large"):
        assert depends_on(run, route, active["deployment"])
        assert not depends_on(run, active["deployment"], route)
        (backend,) = route.inputs["spec"]["rules"][0]["backendRefs"]
        assert backend["name"] == "chat-large-2-3-0" and backend["weight"] == 100
    assert active["deployment"].inputs["spec"]["replicas"] == 4
    assert run.outputs["models"]["chat-large"]["routeWeights"] == {"2.3.0": 100}


@pytest.mark.parametrize("weight,expected", [(0, {"2.3.0": 4, "2.4.0": 1}), (50, {"2.3.0": 2, "2.4.0": 2}),
                                             (100, {"2.3.0": 0, "2.4.0": 4})])
def test_each_step_of_a_rollout(weight, expected):
    run = run_with(with_chat_large(weight=weight))
    out = run.outputs["models"]["chat-large"]
    assert out["replicas"] == expected
    assert out["routeWeights"] == {"2.3.0": 100 - weight, "2.4.0": weight}
    http = routes(run, "chat-large")[0]
    assert {b["name"]: b["weight"] for b in http.inputs["spec"]["rules"][0]["backendRefs"]} == {
        "chat-large-2-3-0": 100 - weight, "chat-large-2-4-0": weight}
    # An active version scaled to zero keeps its Deployment (rollback is one update) but no autoscaler.
    assert ("scaledobject" in parts(run, "chat-large", "2.3.0")) is (expected["2.3.0"] > 0)


def test_rollback_is_one_update_back_to_the_active_version():
    """Rollback: drop the candidate. The active version scales back up before the route changes, and the
    candidate's objects are no longer part of the stack (Pulumi deletes them after the update's creates)."""
    run = run_with(with_chat_large(candidate=None, weight=None))
    assert not [r for r in run.resources if "chat-large-2-4-0" in r.name]
    assert run.outputs["models"]["chat-large"]["versions"] == ["2.3.0"]


def test_versioned_model_serves_each_version_on_its_own_route():
    run = shipped_run("prod-us-west-2")
    out = run.outputs["models"]["ranker"]
    assert out["strategy"] == "versioned" and out["versions"] == ["3.0.0", "4.0.0"]
    assert out["activeVersion"] == "4.0.0"
    hosts = {}
    for version in ("3.0.0", "4.0.0"):
        inst = f"ranker-{version.replace('.', '-')}"
        http = run.find("kubernetes:gateway.networking.k8s.io/v1:HTTPRoute", f"{inst}-http")
        (backend,) = http.inputs["spec"]["rules"][0]["backendRefs"]
        assert backend["name"] == inst and backend["weight"] == 100
        assert depends_on(run, http, parts(run, "ranker", version)["deployment"])
        hosts[version] = http.inputs["spec"]["hostnames"][0]
        assert out["versionEndpoints"][version]["openai"] == f"https://{hosts[version]}/v1"
    assert hosts["3.0.0"] != hosts["4.0.0"]
    # The two versions' fingerprints differ: that is why this model is versioned (§4's rule).
    fingerprints = {v["ioFingerprint"] for m in models_config("prod-us-west-2") if m["id"] == "ranker"
                    for v in m["versions"]}
    assert len(fingerprints) == 2


def test_a_new_serving_image_goes_red_black_like_a_model_version():
    """The active version keeps the digest it runs (pinned from an earlier update's `servingImage` output); a
    candidate with the same package runs the image this update builds, and moves traffic step by step."""
    old_digest = "sha256:" + "a" * 64
    models = copy.deepcopy(models_config())
    chat = next(m for m in models if m["id"] == "chat-large")
    current = next(v for v in chat["versions"] if v["version"] == "2.3.0")
    chat["versions"] = [{**current, "image": old_digest}, {**current, "version": "2.3.0-image2"}]
    chat.update(active="2.3.0", candidate="2.3.0-image2", weight=25)
    run = run_with(models)
    active, candidate = parts(run, "chat-large", "2.3.0"), parts(run, "chat-large", "2.3.0-image2")

    def image(dep: MockedResource) -> str:
        return dep.inputs["spec"]["template"]["spec"]["containers"][0]["image"]

    repository = run.outputs["servingImage"].split("@")[0]
    assert image(active["deployment"]) == f"{repository}@{old_digest}"
    assert image(candidate["deployment"]) == run.outputs["servingImage"] != image(active["deployment"])
    for route in routes(run, "chat-large"):
        assert depends_on(run, route, candidate["deployment"])
        assert depends_on(run, active["deployment"], route)
    assert run.outputs["models"]["chat-large"]["routeWeights"] == {"2.3.0": 75, "2.3.0-image2": 25}


def test_the_active_version_is_the_newest_whatever_the_listing_order():
    """The ranker's versions listed newest first: the outputs' activeVersion and default endpoints are still 4.0.0
    (version order), the version the policy rollout-newest-version-kept protects: with 4.0.0 scaled to zero it
    fires, naming it, although 3.0.0 is listed last."""
    import copy as _copy

    from policies.offline import evaluate

    models = _copy.deepcopy(models_config("prod-us-west-2"))
    ranker = next(m for m in models if m["id"] == "ranker")
    ranker["versions"].reverse()
    assert [v["version"] for v in ranker["versions"]] == ["4.0.0", "3.0.0"]
    run = run_stack("prod-us-west-2", {"models": models})
    out = run.outputs["models"]["ranker"]
    assert out["activeVersion"] == "4.0.0" and out["endpoints"] == out["versionEndpoints"]["4.0.0"]
    assert not [f for f in evaluate(run.resources, run.stack, run.project, run.config) if f.blocking]
    resources = _copy.deepcopy(run.resources)
    parts_of = {r.name: r for r in resources}
    parts_of["ranker-4-0-0-deployment"].inputs["spec"]["replicas"] = 0
    kept = [f.message for f in evaluate(resources, run.stack, run.project, run.config)
            if f.policy == "rollout-newest-version-kept"]
    assert kept and "its newest version '4.0.0' has no Deployment with replicas" in kept[0]
