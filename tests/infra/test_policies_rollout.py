"""Rollout rules (docs/architecture.md §4) on synthetic stacks with red-black and versioned models."""

from __future__ import annotations

import pytest

from tests.infra.policy_support import (
    FINGERPRINT_A,
    FINGERPRINT_B,
    add_model_version,
    compliant_stack,
    fired,
    inputs_of,
    messages,
    model,
    write_compat,
)


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


def red_black_in_progress(weight: int = 25, candidate_replicas: int = 1):
    """llama v1 active, v2 candidate at `weight`: one route with two weighted backends; the candidate is ready
    before the route moves (the route depends on it) and the active scales down after (it depends on the route)."""
    stack = compliant_stack()
    stack.config["llm-serving:models"] = [model(versions=[("v1", FINGERPRINT_A), ("v2", FINGERPRINT_A)],
                                                candidate="v2", weight=weight)]
    add_model_version(stack, "llama", "v2", replicas=candidate_replicas, route=False)
    route = inputs_of(stack, "llama-v1-route")
    route["metadata"]["name"] = "llama"
    route["spec"]["rules"][0]["backendRefs"] = [
        {"name": "llama-v1", "port": 9000.0, "weight": float(100 - weight)},
        {"name": "llama-v2", "port": 9000.0, "weight": float(weight)},
    ]
    route_res, active = stack.get("llama-v1-route"), stack.get("llama-v1")
    route_res.dependencies[:] = [stack.get("gateway-crds").urn, stack.get("llama-v2").urn,
                                 stack.get("llama-v2-svc").urn, stack.get("llama-v1-svc").urn]
    active.dependencies.append(route_res.urn)
    return stack


def versioned(fingerprints=(FINGERPRINT_A, FINGERPRINT_B)):
    stack = compliant_stack()
    stack.config["llm-serving:models"] = [model(versions=[("v1", fingerprints[0]), ("v2", fingerprints[1])],
                                                strategy="versioned")]
    add_model_version(stack, "llama", "v2")
    return stack


def test_compliant_shapes(compat):
    assert red_black_in_progress().evaluate(compat) == []
    assert versioned().evaluate(compat) == []


# -- strategy fits the interface change ----------------------------------------------------------------------------


def test_versioned_without_io_change(compat):
    findings = versioned((FINGERPRINT_A, FINGERPRINT_A)).evaluate(compat)
    assert fired(findings) == {"rollout-versioned-only-on-io-change"}
    assert "is versioned but versions v1, v2 share the I/O fingerprint" in findings[0].message


def test_red_black_across_io_change(compat):
    stack = red_black_in_progress()
    stack.models()[0]["versions"][1]["ioFingerprint"] = FINGERPRINT_B
    findings = stack.evaluate(compat)
    assert fired(findings) == {"rollout-versioned-only-on-io-change"}
    assert "their I/O fingerprints differ" in findings[0].message and "use strategy: versioned" in findings[0].message


# -- weight only toward replicas -----------------------------------------------------------------------------------


def test_weight_to_version_without_replicas(compat):
    stack = red_black_in_progress(weight=25, candidate_replicas=0)
    findings = stack.evaluate(compat)
    # v1, the active version, keeps its replicas: only the traffic rule sees it.
    assert fired(findings) == {"rollout-weight-only-to-replicas"}
    assert messages(findings, "rollout-weight-only-to-replicas") == [
        "route 'llama-v1-route' rule #0 sends weight 25 to 'llama-v2', whose Deployment(s) llama-v2 have 0 replicas"
    ]


def test_zero_weight_to_version_without_replicas_is_fine(compat):
    stack = red_black_in_progress(weight=0, candidate_replicas=0)
    assert "rollout-weight-only-to-replicas" not in fired(stack.evaluate(compat))


def test_route_must_wait_for_candidate(compat):
    stack = red_black_in_progress()
    stack.get("llama-v1-route").dependencies.remove(stack.get("llama-v2").urn)
    findings = stack.evaluate(compat)
    assert fired(findings) == {"rollout-weight-only-to-replicas"}
    assert "without depending on Deployment 'llama-v2'" in findings[0].message


def test_only_the_active_version_may_scale_down_after_the_route(compat):
    stack = red_black_in_progress()
    stack.models()[0].update({"active": "v2", "candidate": "v1"})  # now v1 is the candidate, ordered after the route
    findings = stack.evaluate(compat)
    assert any("without depending on Deployment 'llama-v1'" in m
               for m in messages(findings, "rollout-weight-only-to-replicas"))


def test_default_weight_counts_as_traffic(compat):
    """Gateway API's weight defaults to 1: a backendRef without weight carries traffic."""
    stack = compliant_stack()
    del inputs_of(stack, "llama-v1-route")["spec"]["rules"][0]["backendRefs"][0]["weight"]
    inputs_of(stack, "llama-v1")["spec"]["replicas"] = 0.0
    stack.models()[0]["replicas"] = 1
    findings = stack.evaluate(compat)
    assert any("sends weight 1 to 'llama-v1'" in m for m in messages(findings, "rollout-weight-only-to-replicas"))


def test_route_to_unknown_service(compat):
    stack = compliant_stack()
    inputs_of(stack, "llama-v1-route")["spec"]["rules"][0]["backendRefs"][0]["name"] = "ghost"
    findings = stack.evaluate(compat)
    assert "which is not a Service of this stack" in messages(findings, "rollout-weight-only-to-replicas")[0]


def test_service_selecting_nothing(compat):
    stack = compliant_stack()
    inputs_of(stack, "llama-v1-svc")["spec"]["selector"]["app.kubernetes.io/version"] = "v9"
    findings = stack.evaluate(compat)
    assert "a Service that selects no Deployment of this stack" in messages(
        findings, "rollout-weight-only-to-replicas")[0]


def test_all_zero_weights_drop_traffic(compat):
    stack = compliant_stack()
    inputs_of(stack, "llama-v1-route")["spec"]["rules"][0]["backendRefs"][0]["weight"] = 0.0
    findings = stack.evaluate(compat)
    assert fired(findings) == {"rollout-weight-only-to-replicas"}
    assert "every backend has weight 0" in findings[0].message


# -- newest version kept -------------------------------------------------------------------------------------------


def test_newest_version_removed(compat):
    stack = versioned()
    for name in ("llama-v2", "llama-v2-svc", "llama-v2-pdb", "llama-v2-route"):
        stack.remove(name)
    findings = stack.evaluate(compat)
    assert fired(findings) == {"rollout-newest-version-kept"}
    assert "its newest version 'v2' has no Deployment with replicas" in findings[0].message


def test_newest_version_scaled_to_zero(compat):
    stack = versioned()
    inputs_of(stack, "llama-v2")["spec"]["replicas"] = 0.0
    assert "rollout-newest-version-kept" in fired(stack.evaluate(compat))


def test_versioned_newest_needs_its_own_route(compat):
    stack = versioned()
    stack.remove("llama-v2-route")
    findings = stack.evaluate(compat)
    assert fired(findings) == {"rollout-newest-version-kept"}
    assert "its newest version 'v2' has no route of its own" in findings[0].message


def test_newest_is_by_version_order_not_list_order(compat):
    """v10 is newer than v9 although it sorts first as text and is listed first."""
    stack = compliant_stack()
    stack.config["llm-serving:models"] = [model(versions=[("v10", FINGERPRINT_A), ("v9", FINGERPRINT_B)],
                                                strategy="versioned")]
    for name in ("llama-v1", "llama-v1-svc", "llama-v1-pdb", "llama-v1-route"):
        stack.remove(name)
    add_model_version(stack, "llama", "v9")
    findings = stack.evaluate(compat)
    assert "its newest version 'v10' has no Deployment" in messages(findings, "rollout-newest-version-kept")[0]


def test_a_red_black_rollout_back_to_a_lower_version_may_scale_the_higher_one_to_zero(compat):
    """v2 was finalized; the rollout back to v1 reaches weight 100: v1 has all the traffic and v2 no replicas. The
    protected version is the one with the traffic, not the higher number, so the last step passes."""
    stack = red_black_in_progress(weight=100)
    stack.models()[0].update(active="v2", candidate="v1")
    route = inputs_of(stack, "llama-v1-route")
    route["spec"]["rules"][0]["backendRefs"] = [{"name": "llama-v1", "port": 9000.0, "weight": 100.0},
                                                {"name": "llama-v2", "port": 9000.0, "weight": 0.0}]
    inputs_of(stack, "llama-v2")["spec"]["replicas"] = 0.0
    assert "rollout-newest-version-kept" not in fired(stack.evaluate(compat))
    # v1, the version with all the traffic, scaled to zero instead: refused, naming it.
    inputs_of(stack, "llama-v2")["spec"]["replicas"] = 2.0
    inputs_of(stack, "llama-v1")["spec"]["replicas"] = 0.0
    assert "its active version (all of its traffic) 'v1' has no Deployment with replicas" in messages(
        stack.evaluate(compat), "rollout-newest-version-kept")[0]


def test_invalid_model_config_is_reported_with_the_key(compat):
    stack = compliant_stack()
    stack.models()[0]["strategy"] = "canary"
    findings = stack.evaluate(compat)
    assert any("llm-serving:models[0].strategy" in f.message for f in findings)
    assert any(f.policy == "rollout-newest-version-kept" and f.enforcement == "mandatory" for f in findings)


# -- autoscalers and the GPU surge bound ---------------------------------------------------------------------------


def _scaled_object(stack, deployment, **spec):
    stack.add("kubernetes:keda.sh/v1alpha1:ScaledObject", f"{deployment}-scaler", {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": deployment, "namespace": "llm-serving"},
        "spec": {"scaleTargetRef": {"name": deployment}, "maxReplicaCount": 4.0, **spec}}, depends_on=["keda"])


def test_autoscaler_with_a_floor_is_fine(compat):
    stack = compliant_stack()
    _scaled_object(stack, "llama-v1", minReplicaCount=1.0)
    assert stack.evaluate(compat) == []


@pytest.mark.parametrize("spec", [{}, {"minReplicaCount": 0.0}], ids=["keda-default", "explicit-zero"])
def test_autoscaler_may_scale_weighted_version_to_zero(spec, compat):
    stack = compliant_stack()
    _scaled_object(stack, "llama-v1", **spec)
    findings = stack.evaluate(compat)
    assert fired(findings) == {"rollout-weight-only-to-replicas"}
    assert "may scale Deployment 'llama-v1' to zero (minimum 0) while it holds that weight" in findings[0].message


def test_hpa_defaults_to_one_replica(compat):
    stack = compliant_stack()
    stack.add("kubernetes:autoscaling/v2:HorizontalPodAutoscaler", "llama-v1-hpa", {
        "metadata": {"name": "llama-v1", "namespace": "llm-serving"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama-v1"},
                 "maxReplicas": 4.0}})
    assert stack.evaluate(compat) == []


def test_red_black_surge_bound(compat):
    stack = red_black_in_progress(weight=25, candidate_replicas=2)  # 2 + 2 for replicas: 2
    findings = stack.evaluate(compat)
    assert fired(findings) == {"rollout-gpu-surge-bound"}
    assert messages(findings, "rollout-gpu-surge-bound") == [
        "model 'llama' runs 4 replicas (llama-v1=2, llama-v2=2) for replicas: 2: a red-black step may add at most "
        "one replica of surge (§4), never a second full copy of its GPUs"]


def test_versioned_overlap_is_not_a_surge(compat):
    assert "rollout-gpu-surge-bound" not in fired(versioned().evaluate(compat))
