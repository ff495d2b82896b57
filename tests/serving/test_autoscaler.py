"""rehearsal/autoscaler.py: what KEDA and the HPA controller do with a ScaledObject over time, against the rules the
module's docstring cites. Deterministic: every poll's time is the test's own.

RENDERED is a ScaledObject spec as infra/serving.py `scaled_object_spec` renders it (threshold 8, floor 2, ceiling
10); tests/infra/test_autoscaler_stack.py builds the emulation from the shipped stacks' real ones."""

from __future__ import annotations

import copy
import re

import pytest

from rehearsal.autoscaler import Autoscaler, Decision

RENDERED = {
    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat-small-v1"},
    "minReplicaCount": 2,
    "maxReplicaCount": 10,
    "pollingInterval": 15,
    "cooldownPeriod": 600,
    "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {
        "stabilizationWindowSeconds": 600, "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}],
    }}}},
    "fallback": {"failureThreshold": 3, "replicas": 2, "behavior": "currentReplicas"},
    "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
        "serverAddress": "http://prometheus:9090", "query": 'sum(vllm:num_requests_waiting{namespace="llm"})',
        "threshold": "8", "ignoreNullValues": "false",
    }}],
}
FAILURES = RENDERED["fallback"]["failureThreshold"]
# A scale-down the HPA applies at once (the defaults' Percent 100 without their 300 s window).
PROMPT_SCALE_DOWN = {"stabilizationWindowSeconds": 0,
                     "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}]}


def spec(edit=None) -> dict:
    doc = copy.deepcopy(RENDERED)
    if edit:
        edit(doc)
    return doc


def behavior(doc: dict) -> dict:
    return doc["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]


def run(scaler: Autoscaler, values: list[float | None], current: int, start: float = 0.0) -> list[Decision]:
    """A poll every pollingInterval, each decision applied to the Deployment before the next."""
    decisions = []
    for i, value in enumerate(values):
        decisions.append(scaler.poll(start + i * scaler.polling_interval_s, value, current))
        current = decisions[-1].replicas
    return decisions


def test_average_value_divides_the_query_by_the_target_whatever_the_current_replicas():
    """External AverageValue: usage per replica against the target, so desired = ceil(value / target)."""
    assert Autoscaler.from_scaled_object(spec()).poll(0, 40, 2) == Decision(5, "ceil(40 / 8)")
    assert Autoscaler.from_scaled_object(spec()).poll(0, 40, 4) == Decision(5, "ceil(40 / 8)")
    assert Autoscaler.from_scaled_object(spec()).poll(0, 40, 5) == Decision(5, "within tolerance")


def test_a_change_within_the_tolerance_does_not_scale():
    target_for_two = 2 * 8
    assert Autoscaler.from_scaled_object(spec()).poll(0, target_for_two * 1.09, 2) == Decision(2, "within tolerance")
    assert Autoscaler.from_scaled_object(spec()).poll(0, target_for_two * 1.11, 2) == Decision(3, "ceil(17.76 / 8)")


def test_scale_up_is_immediate_at_the_default_policies_rate():
    """No scale-up window; 4 pods or 100% per 15 s, whichever allows more (selectPolicy Max)."""
    def up_to_30(doc):
        doc["minReplicaCount"], doc["maxReplicaCount"] = 1, 30

    scaler = Autoscaler.from_scaled_object(spec(up_to_30))
    assert scaler.poll(0, 1000, 1) == Decision(5, "limited by policy Pods 4/15s")
    # Within the same 15 s the period still starts at 1 replica: no further step.
    assert scaler.poll(10, 1000, 5) == Decision(5, "limited by policy Pods 4/15s")
    assert [d.replicas for d in run(scaler, [1000] * 3, 5, start=15)] == [10, 20, 30]
    assert scaler.poll(60, 1000, 30) == Decision(30, "clamped to maxReplicaCount")


def test_scale_down_waits_for_the_window_then_steps_one_pod_per_period():
    """The highest recommendation of the last 600 s holds the count; then the rendered Pods 1 per 300 s policy."""
    scaler = Autoscaler.from_scaled_object(spec())
    loaded, *idle = run(scaler, [200] + [0] * 200, 10)
    assert loaded == Decision(10, "clamped to maxReplicaCount")
    by_time = {15 * (i + 1): d for i, d in enumerate(idle)}
    assert {d for t, d in by_time.items() if t < 600} == {Decision(10, "stabilized (scale-down window)")}
    assert by_time[600] == Decision(9, "limited by policy Pods 1/300s")
    assert {by_time[t].replicas for t in range(615, 900, 15)} == {9}
    assert [by_time[600 + 300 * k].replicas for k in range(8)] == [9, 8, 7, 6, 5, 4, 3, 2]
    assert by_time[3000] == Decision(2, "clamped to minReplicaCount")


def test_the_bounds_clamp_the_metric_and_a_count_outside_them():
    def prompt_down(doc):
        behavior(doc)["scaleDown"] = PROMPT_SCALE_DOWN

    assert Autoscaler.from_scaled_object(spec()).poll(0, 1000, 10) == Decision(10, "clamped to maxReplicaCount")
    assert Autoscaler.from_scaled_object(spec(prompt_down)).poll(0, 0, 5) == Decision(2, "clamped to minReplicaCount")
    assert Autoscaler.from_scaled_object(spec()).poll(0, 0, 12) == Decision(10, "above maxReplicaCount")
    assert Autoscaler.from_scaled_object(spec()).poll(0, 1000, 1) == Decision(2, "below minReplicaCount")


def test_the_fallback_keeps_the_current_replicas_once_the_failed_polls_pass_the_threshold():
    """No series is the scaler's error (ignoreNullValues "false"): the HPA, without a metric, holds for
    FAILURES polls; once they are passed KEDA hands it target x current replicas, which is within tolerance."""
    decisions = run(Autoscaler.from_scaled_object(spec()), [None] * (FAILURES + 2), 4)
    assert decisions[:FAILURES] == [Decision(4, f"no metric (failed poll {n}, fallback after {FAILURES}): no change")
                                    for n in range(1, FAILURES + 1)]
    assert decisions[FAILURES:] == [Decision(4, f"fallback: currentReplicas after {n} failed polls, within tolerance")
                                    for n in (FAILURES + 1, FAILURES + 2)]


def test_a_successful_poll_resets_the_failure_count():
    decisions = run(Autoscaler.from_scaled_object(spec()), [None] * FAILURES + [32] + [None] * (FAILURES + 1), 4)
    assert decisions[FAILURES] == Decision(4, "within tolerance")
    assert [d.reason.startswith("no metric") for d in decisions[FAILURES + 1:]] == [True] * FAILURES + [False]
    assert decisions[-1].reason.startswith("fallback: currentReplicas after 4 failed polls")


def test_a_static_fallback_goes_through_the_hpa_behavior():
    """KEDA only substitutes the metric: a fallback to fewer replicas waits for the scale-down window as any other."""
    def static(doc):
        doc["fallback"]["behavior"] = "static"

    decisions = run(Autoscaler.from_scaled_object(spec(static)), [32] + [None] * (FAILURES + 1), 4)
    assert decisions[-1] == Decision(4, "fallback: static after 4 failed polls, stabilized (scale-down window)")


def test_ignore_null_values_true_reads_no_series_as_an_empty_queue():
    def ignore_nulls(doc):
        doc["triggers"][0]["metadata"]["ignoreNullValues"] = "true"

    decisions = run(Autoscaler.from_scaled_object(spec(ignore_nulls)), [None] * (FAILURES + 2), 4)
    assert decisions[0] == Decision(3, "no value read as 0 (ignoreNullValues true), limited by policy Pods 1/300s")
    assert not any("fallback" in d.reason for d in decisions)
    assert Autoscaler.from_scaled_object(spec()).poll(0, None, 4).replicas == 4  # as rendered: no data, no change


@pytest.mark.parametrize(("direction", "rules", "current", "value", "expected"), [
    ("scaleUp", {"selectPolicy": "Min"}, 2, 1000, Decision(4, "limited by policy Percent 100%/15s")),
    ("scaleUp", {"selectPolicy": "Disabled"}, 3, 1000, Decision(3, "scale-up disabled (selectPolicy Disabled)")),
    ("scaleDown", {**PROMPT_SCALE_DOWN, "selectPolicy": "Disabled"}, 6, 0,
     Decision(6, "scale-down disabled (selectPolicy Disabled)")),
])
def test_select_policy_min_takes_the_smallest_change_and_disabled_none(direction, rules, current, value, expected):
    def edit(doc):
        behavior(doc)[direction] = rules

    assert Autoscaler.from_scaled_object(spec(edit)).poll(0, value, current) == expected


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d["triggers"][0].update(type="cpu"), "spec.triggers[0].type"),
    (lambda d: d["triggers"][0].update(metricType="Value"), "spec.triggers[0].metricType"),
    (lambda d: d["fallback"].update(behavior="currentReplicasIfBusy"), "spec.fallback.behavior"),
    (lambda d: d.update(idleReplicaCount=0), "spec.idleReplicaCount"),
    (lambda d: d.update(minReplicaCount=0), "spec.minReplicaCount"),
    (lambda d: d["triggers"].append(d["triggers"][0]), "spec.triggers"),
    (lambda d: d["triggers"][0]["metadata"].update(activationThreshold="1"),
     "spec.triggers[0].metadata.activationThreshold"),
    (lambda d: behavior(d)["scaleDown"].update(tolerance=0.05),
     "spec.advanced.horizontalPodAutoscalerConfig.behavior.scaleDown.tolerance"),
    (lambda d: behavior(d)["scaleDown"]["policies"][0].update(type="Replicas"),
     "spec.advanced.horizontalPodAutoscalerConfig.behavior.scaleDown.policies[0].type"),
    (lambda d: d["advanced"].update(scalingModifiers={}), "spec.advanced.scalingModifiers"),
])
def test_a_field_it_does_not_model_is_refused_by_name(edit, field):
    with pytest.raises(ValueError, match="^" + re.escape(field) + ":"):
        Autoscaler.from_scaled_object(spec(edit))
