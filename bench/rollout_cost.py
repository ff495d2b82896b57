"""GPU-hours of a red-black rollout against a versioned one for the same schedule (docs/architecture.md §4).

Computed from the rollout planner (infra.rollout.planner), not measured on GPUs (there are none here): the same
arithmetic that sets the Deployments' replicas in every stack update.

Schedule: the operator's steps (10/25/50/100), each weight held `HOURS_PER_STEP` hours (the bake time between
analysis gates). Red-black runs the planner's replicas at each weight (replicas + at most `surge` while a step
moves) and finalizes at the end. Versioned runs both versions at full replicas while consumers move over the same
period, then until the old version has had no request for the idle window (when the next update removes it).
The baseline is one version at full replicas; the tables report the extra GPU-hours the rollout costs.
"""

from __future__ import annotations

import pathlib

from bench.report import main, pyplot, result, save_figure
from infra.rollout.planner import DEFAULT_STEPS, PlanError, plan_red_black, schedule

HOURS_PER_STEP = 2.0
GPUS_PER_REPLICA = 8  # chat-large: 8 GPUs per replica (p5.48xlarge)
REPLICAS = (2, 4, 8, 16)
IDLE_WINDOWS_H = (24.0, 168.0)  # 1 day, and the command's default 7 days


def min_surge(replicas: int) -> int:
    """The smallest surge for which the planner finds a schedule (1 when 100/replicas steps land on whole
    replicas, else 2: see planner.next_weight)."""
    for surge in range(1, replicas + 2):
        try:
            schedule(replicas, DEFAULT_STEPS, surge)
            return surge
        except PlanError:
            continue
    raise AssertionError("surge = replicas + 1 always has a schedule")


def red_black_timeline(replicas: int, surge: int | None = None) -> list[tuple[float, int]]:
    """(hours since the rollout began, replicas) at each weight of the schedule; ends after finalizing."""
    points, t = [], 0.0
    for weight in schedule(replicas, DEFAULT_STEPS, surge or min_surge(replicas)):
        points.append((t, plan_red_black("old", replicas, "new", weight).total_replicas))
        t += HOURS_PER_STEP
    points.append((t, replicas))  # finalized: the old version's Deployment is gone
    return points


def extra_gpu_hours_red_black(replicas: int, surge: int | None = None) -> float:
    timeline = red_black_timeline(replicas, surge)
    return sum((n - replicas) * GPUS_PER_REPLICA * (t2 - t1)
               for (t1, n), (t2, _) in zip(timeline, timeline[1:], strict=False))


def versioned_overlap_hours(replicas: int, idle_window_h: float) -> float:
    """Consumers move over the same period as the red-black schedule, then the old version must be idle for the
    whole window before an update may remove it."""
    return len(schedule(replicas, DEFAULT_STEPS, min_surge(replicas))) * HOURS_PER_STEP + idle_window_h


def extra_gpu_hours_versioned(replicas: int, idle_window_h: float) -> float:
    return replicas * GPUS_PER_REPLICA * versioned_overlap_hours(replicas, idle_window_h)


def run(out_dir: pathlib.Path) -> dict:
    lines = [
        f"Extra GPU-hours of one rollout over the steady state ({GPUS_PER_REPLICA} GPUs per replica, each step held "
        f"{HOURS_PER_STEP:g} h, the smallest surge that has a schedule; computed by the rollout planner, the same "
        "arithmetic the stack updates use; a step's transient of minutes is left out).",
        "",
        "| replicas | surge | red-black weights | red-black extra GPU-h | versioned extra GPU-h (1 d idle) | "
        "versioned extra GPU-h (7 d idle) | ratio versioned/red-black (1 d) |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    rows = []
    for r in REPLICAS:
        rb = extra_gpu_hours_red_black(r)
        v1, v7 = (extra_gpu_hours_versioned(r, w) for w in IDLE_WINDOWS_H)
        rows.append((r, rb, v1, v7))
        surge = min_surge(r)
        weights = "/".join(str(w) for w in schedule(r, DEFAULT_STEPS, surge))
        lines.append(f"| {r} | {surge} | {weights} | {rb:g} | {v1:g} | {v7:g} | {v1 / rb:.0f}x |")
    lines += ["", "Red-black never holds more than `surge` extra replicas (the planner splits a step that would need "
              "more, e.g. 50 -> 75 -> 100 for 4 replicas); versioned holds a second full copy until the old version is "
              "idle, which is why it is kept for I/O schema changes only (§4)."]
    plot = _plot(out_dir, rows)
    return result("Rollouts: GPU-hours of red-black vs versioned", lines, [plot])


def _plot(out_dir: pathlib.Path, rows: list[tuple[int, float, float, float]]) -> pathlib.Path:
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    r = 4
    timeline = red_black_timeline(r)
    ts = [t for t, _ in timeline]
    left.step(ts, [n * GPUS_PER_REPLICA for _, n in timeline], where="post", label="red-black")
    overlap = versioned_overlap_hours(r, IDLE_WINDOWS_H[0])
    left.step([0, overlap, overlap + HOURS_PER_STEP], [2 * r * GPUS_PER_REPLICA, r * GPUS_PER_REPLICA,
                                                       r * GPUS_PER_REPLICA], where="post",
              label="versioned (1 d idle window)")
    left.axhline(r * GPUS_PER_REPLICA, color="grey", linestyle=":", label="steady state")
    left.set(xlabel="hours since the rollout began", ylabel="GPUs", title=f"{r} replicas x {GPUS_PER_REPLICA} GPUs",
             ylim=(0, 2.2 * r * GPUS_PER_REPLICA))
    left.legend()
    xs = range(len(rows))
    width = 0.27
    right.bar([x - width for x in xs], [row[1] for row in rows], width, label="red-black")
    right.bar(list(xs), [row[2] for row in rows], width, label="versioned, 1 d idle")
    right.bar([x + width for x in xs], [row[3] for row in rows], width, label="versioned, 7 d idle")
    right.set_xticks(list(xs), [str(row[0]) for row in rows])
    right.set(xlabel="replicas", ylabel="extra GPU-hours per rollout", yscale="log",
              title="extra GPU-hours of one rollout")
    right.legend()
    return save_figure(fig, out_dir, "rollout_cost.png")


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
