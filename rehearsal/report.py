"""`build/rehearsal/report.md` and its plot: what each rollout scenario did to the route weights, the Ready pods per
version and the requests, second by second, the lines `make rehearse` printed, and the experiment driven through the
gateway: each arm's count on Prometheus beside the client's (experiment.py)."""

from __future__ import annotations

import time
from pathlib import Path

from rehearsal.experiment import ExperimentCheck
from rehearsal.scenarios import ScenarioResult


def plot(results: list[ScenarioResult], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 3, figsize=(15, 3.4 * len(results)), squeeze=False)
    for row, result in zip(axes, results, strict=True):
        times = [s.at for s in result.samples]
        versions = sorted({v for s in result.samples for v in (*s.weights, *s.ready)})
        for version in versions:
            row[0].step(times, [s.weights.get(version, 0) for s in result.samples], where="post", label=version)
            row[1].step(times, [s.ready.get(version, 0) for s in result.samples], where="post", label=version)
        row[0].set_title(f"{result.name}: route weight per version")
        row[0].set_ylim(-5, 105)
        row[1].set_title(f"{result.name}: Ready pods per version (peak {result.peak_pods}, bound {result.bound})")
        row[1].axhline(result.bound, color="grey", linestyle=":", linewidth=1)
        row[2].plot(times, [s.requests - s.failed for s in result.samples], label="succeeded")
        row[2].plot(times, [s.failed for s in result.samples], label="failed", color="tab:red")
        row[2].set_title(f"{result.name}: requests (cumulative)")
        for ax in row:
            ax.set_xlabel("seconds")
            ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def experiment_section(check: ExperimentCheck) -> list[str]:
    """The experiment's arms: the units the client assigned, its calls and errors, and the pods' count on Prometheus
    (what an analysis of the experiment would read), side by side."""
    lines = [f"## Experiment {check.experiment} through the gateway", "",
             f"The client library (`Client.chat(experiment=..., unit=...)`, its routes dialled at the gateway) for "
             f"{sum(a.units for a in check.arms)} fixed {check.unit}s; `llm_serving_experiment_requests_total` by arm "
             f"from the rehearsal's Prometheus.", "",
             "| arm | percent | units | client calls | client errors | Prometheus | result |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for a in check.arms:
        same = a.prometheus is not None and a.prometheus > 0 and a.prometheus == a.client_calls
        lines.append(f"| {a.arm} | {a.percent:g} | {a.units} | {a.client_calls} | {a.client_errors} | "
                     f"{'-' if a.prometheus is None else a.prometheus} | {'ok' if same else 'FAILED'} |")
    lines.append("")
    lines += [f"- {p}" for p in check.problems]
    return [*lines, ""] if check.problems else lines


def write(results: list[ScenarioResult], stack: str, final_line: str, out_dir: Path,
          experiment: ExperimentCheck | None = None) -> Path:
    lines = [f"# Rehearsal of {stack}" + (": rollouts under load" if results else ""), "",
             f"Written by `make rehearse` on {time.strftime('%Y-%m-%d %H:%M:%S %Z')}.", "", "```"]
    lines += [r.line for r in results] + ([f"experiment {experiment.experiment}: "
                                           + ("ok" if experiment.ok else "FAILED")] if experiment else [])
    lines += [final_line, "```", ""]
    if experiment is not None:
        lines += experiment_section(experiment)
    if not results:  # --no-scenarios: no rollout, no plot
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "report.md"
        path.write_text("\n".join(lines))
        return path
    image = plot(results, out_dir / "rollouts.png")
    lines += ["| scenario | requests | failed | peak pods | planner's bound (replicas + surge) | result |",
              "| --- | ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {r.name} | {r.requests} | {r.failed} | {r.peak_pods} | {r.bound} | {'ok' if r.ok else 'FAILED'} |"
              for r in results]
    lines += ["", f"![route weights, Ready pods and requests over time]({image.name})", ""]
    for r in results:
        lines += [f"## {r.name}", ""]
        for report in r.reports:
            for stack_report in report.get("stacks", []):
                gate = stack_report.get("gate") or {}
                verdict = (f" (gate: {'pass' if gate.get('passed') else 'FAIL'}"
                           f"{': ' + gate['reason'] if gate.get('reason') else ''})" if gate else "")
                lines.append(f"- `rollout {report.get('action')}`: {stack_report.get('status')} "
                             f"{stack_report.get('before', '')} -> {stack_report.get('after', '')} "
                             f"{stack_report.get('detail', '')}".rstrip() + verdict)
        if r.failures:
            lines += ["", "Failed requests (first ten):", ""] + [f"- {f}" for f in r.failures]
        lines.append("")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
