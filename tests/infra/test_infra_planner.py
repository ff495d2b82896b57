"""Properties of the red-black arithmetic (infra/rollout/planner.py), for every replicas/weight combination."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infra.rollout.planner import PlanError, plan_red_black

replicas = st.integers(min_value=1, max_value=200)
weights = st.integers(min_value=0, max_value=100)


@given(replicas, weights, st.integers(min_value=0, max_value=50))
def test_a_step_never_exceeds_one_replica_of_surge_and_honours_the_weights(r, w, extra):
    plan = plan_red_black("1", r, "2", w, max_replicas=r + extra)
    assert plan.total_replicas <= r + 1
    assert plan.active.weight + plan.candidate.weight == 100
    assert plan.candidate.weight == w
    # each side has at least the share of the model's replicas its traffic share asks for
    assert plan.candidate.replicas >= max(1, math.ceil(r * w / 100))
    assert plan.active.replicas >= math.ceil(r * (100 - w) / 100)
    # the candidate always runs (it must pass its health checks before any traffic moves)
    assert plan.candidate.replicas >= 1
    # autoscaling bounds never go below the floor and never undo the split
    for share in plan.shares:
        assert share.max_replicas >= share.replicas
        assert share.max_replicas <= r + extra


@given(replicas, st.integers(min_value=0, max_value=99))
def test_more_weight_never_gives_the_candidate_fewer_replicas(r, w):
    low, high = plan_red_black("1", r, "2", w), plan_red_black("1", r, "2", w + 1)
    assert high.candidate.replicas >= low.candidate.replicas
    assert high.active.replicas <= low.active.replicas


@given(replicas)
def test_without_a_candidate_the_active_version_has_everything(r):
    plan = plan_red_black("1", r)
    assert plan.candidate is None
    assert (plan.active.replicas, plan.active.weight) == (r, 100)


def test_the_ends_of_a_rollout():
    assert [(s.replicas, s.weight) for s in plan_red_black("a", 4, "b", 0).shares] == [(4, 100), (1, 0)]
    assert [(s.replicas, s.weight) for s in plan_red_black("a", 4, "b", 100).shares] == [(0, 0), (4, 100)]
    assert plan_red_black("a", 4, "b", 100).active.max_replicas == 0


@pytest.mark.parametrize("kwargs,message", [
    ({"replicas": 0}, "replicas must be at least 1"),
    ({"candidate": "a", "weight": 10}, "is the active version"),
    ({"candidate": "b", "weight": 101}, "candidate weight must be 0..100"),
    ({"candidate": "b"}, "candidate weight must be 0..100"),
    ({"weight": 30}, "weight 30 without a candidate"),
    ({"max_replicas": 1}, "max_replicas (1) is below replicas (4)"),
])
def test_bad_arguments_are_refused(kwargs, message):
    args = {"active": "a", "replicas": 4, **kwargs}
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_red_black(**args)
