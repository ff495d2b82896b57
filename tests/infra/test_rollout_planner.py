"""The red-black arithmetic (infra.rollout.planner), property-tested with hypothesis."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.rollout.planner import (
    DEFAULT_STEPS,
    PlanError,
    active_replicas,
    candidate_replicas,
    check_steps,
    next_weight,
    plan_red_black,
    red_black_replica_hours,
    rollback_peak,
    schedule,
    transition_peak,
    versioned_replica_hours,
)

replicas_st = st.integers(min_value=1, max_value=100)
steps_st = st.lists(st.integers(1, 99), max_size=6, unique=True).map(lambda xs: tuple(sorted(xs)) + (100,))


@given(replicas_st, st.integers(0, 100), st.integers(0, 50))
def test_weights_sum_to_100_and_each_version_has_the_replicas_its_weight_needs(replicas, weight, extra_max):
    plan = plan_red_black("v1", replicas, "v2", weight, replicas + extra_max)
    assert sum(s.weight for s in plan.shares) == 100
    for share in plan.shares:
        # a version with traffic has at least its share of the replicas (rounded up), and at least one
        if share.weight:
            assert share.replicas >= max(1, math.ceil(replicas * share.weight / 100))
        assert share.max_replicas >= share.replicas
    assert plan.candidate.replicas >= 1  # ready before any traffic moves (weight 0 is "deploy and verify")
    assert replicas <= plan.total_replicas <= replicas + 1


@given(replicas_st)
def test_without_a_candidate_the_active_has_everything(replicas):
    plan = plan_red_black("v1", replicas)
    assert plan.candidate is None and (plan.active.replicas, plan.active.weight) == (replicas, 100)


@settings(max_examples=150, deadline=None)
@given(replicas_st, steps_st, st.integers(1, 3))
def test_schedule_keeps_every_update_within_replicas_plus_surge(replicas, steps, surge):
    try:
        weights = schedule(replicas, steps, surge)
    except PlanError as err:
        # Only when no sequence of integer weights can keep the bound; the message says what surge would.
        assert f"surge {surge} is too small for {replicas} replicas" in str(err)
        enough = int(str(err).rsplit("raise surge to ", 1)[1])
        assert enough > surge
        assert schedule(replicas, steps, max(enough, 2))[-1] == 100
        return
    assert weights[-1] == 100 and weights == sorted(set(weights))
    assert set(steps) <= set(weights)  # every operator step is an update (and an analysis point)
    previous = None
    for weight in weights:
        assert transition_peak(replicas, previous, weight) <= replicas + surge
        previous = weight


@settings(deadline=None)
@given(replicas_st, steps_st)
def test_surge_two_always_suffices_up_to_100_replicas(replicas, steps):
    assert schedule(replicas, steps, 2)[-1] == 100


@given(replicas_st, st.integers(0, 100))
def test_rollback_peak_is_replicas_plus_the_candidates(replicas, weight):
    plan = plan_red_black("v1", replicas, "v2", weight)
    assert rollback_peak(replicas, weight) == replicas + plan.candidate.replicas


def test_shipped_prod_schedules():
    # prod-us-east-1's chat-large (4 replicas): 100 would need 2 + 4 replicas from 50, so 75 is inserted.
    assert schedule(4) == [10, 25, 50, 75, 100]
    assert schedule(2) == list(DEFAULT_STEPS)
    assert next_weight(4, 25) == 50 and next_weight(4, 50) == 75 and next_weight(4, None) == 10


@pytest.mark.parametrize("steps, message", [
    ((), "at least one weight"),
    ((10, 50), "the last weight must be 100"),
    ((50, 10, 100), "strictly increase"),
    ((0, 100), "integer in 1..100"),
    ((10, 101), "integer in 1..100"),
])
def test_bad_step_lists_are_named(steps, message):
    with pytest.raises(PlanError, match=message):
        check_steps(steps)


def test_bad_inputs_are_named():
    with pytest.raises(PlanError, match="surge must be at least 1"):
        next_weight(4, 10, surge=0)
    with pytest.raises(PlanError, match="finalizes"):
        next_weight(4, 100)
    with pytest.raises(PlanError, match="surge 1 is too small for 6 replicas.*raise surge to 2"):
        schedule(6)
    with pytest.raises(PlanError, match="candidate weight must be 0..100"):
        plan_red_black("v1", 4, "v2", 101)


def test_replica_hours():
    # 4 replicas, each weight held an hour: 5 + 4 + 4 + 4 + 4 replicas at 10, 25, 50, 75, 100.
    assert red_black_replica_hours(4, schedule(4), 1.0) == 21
    assert versioned_replica_hours(4, 5.0) == 40


@given(replicas_st, st.integers(0, 100))
def test_fast_replica_counts_match_the_plan(replicas, weight):
    plan = plan_red_black("v1", replicas, "v2", weight)
    assert candidate_replicas(replicas, weight) == plan.candidate.replicas
    assert active_replicas(replicas, weight) == plan.active.replicas
