"""The cost report (bench/rollout_cost.py): shape for `make bench`, and numbers that follow from the planner."""

from __future__ import annotations

from bench.rollout_cost import (
    GPUS_PER_REPLICA,
    HOURS_PER_STEP,
    extra_gpu_hours_red_black,
    extra_gpu_hours_versioned,
    min_surge,
    red_black_timeline,
    run,
)


def test_report_and_plot(tmp_path):
    result = run(tmp_path)
    assert set(result) == {"title", "markdown", "plots"}
    (plot,) = result["plots"]
    assert open(plot, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "| 4 | 1 | 10/25/50/75/100 | 16 |" in result["markdown"]


def test_numbers():
    # 4 replicas: one extra replica only while at 10% (5 replicas for one step), then 4 at every weight.
    assert red_black_timeline(4) == [(0.0, 5), (2.0, 4), (4.0, 4), (6.0, 4), (8.0, 4), (10.0, 4)]
    assert extra_gpu_hours_red_black(4) == 1 * GPUS_PER_REPLICA * HOURS_PER_STEP
    # versioned: a second full copy over the 5 steps plus a day of idleness
    assert extra_gpu_hours_versioned(4, 24) == 4 * GPUS_PER_REPLICA * (5 * HOURS_PER_STEP + 24)
    assert (min_surge(4), min_surge(6), min_surge(8)) == (1, 2, 2)
    for r in (1, 2, 3, 4, 8, 16):
        assert extra_gpu_hours_red_black(r) < extra_gpu_hours_versioned(r, 0)
