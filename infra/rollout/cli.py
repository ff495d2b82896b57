"""`llm-serving rollout start|advance|abort|status MODEL --stacks S1,S2,...` (docs/architecture.md §4).

Edits `stacks/Pulumi.<stack>.yaml` in place and runs one update per stack through a stack runner:
`--runner automation` (default; Pulumi's Automation API, needs the Pulumi CLI and cloud credentials) or
`--runner mock` (the real program under Pulumi's mock runtime plus the simulator of infra.rollout.simulator,
with its state under --state-dir; what the tests use). Runs in `.venv-infra`.

The mock runner's policy check is injected: `main(argv, policy_gate=...)` takes an `infra.rollout.runner.PolicyGate`
(why: see its docstring; infra never imports policies). `llm-serving rollout` (llm_serving_cli.main) passes the
policy pack's (`policies.gate.blocking_violations`); the tests pass it explicitly.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from infra.config import REPO_ROOT, ConfigError
from infra.rollout.gate import GateThresholds, PrometheusClient, duration_seconds
from infra.rollout.planner import DEFAULT_STEPS, PlanError, check_steps
from infra.rollout.simulator import Faults
from llm_serving.pod_contract import PodContractError, package_uri

try:  # ruamel.yaml and the Pulumi SDKs are in .venv-infra only; `llm-serving` is installed in both venvs
    from infra.rollout.orchestrate import Options, Report, Rollout, RolloutError, prometheus_gate
    from infra.rollout.replication import s3_replica_check
    from infra.rollout.runner import PolicyGate, RunnerUnavailable
    from infra.rollout.stackfile import StackFile, StackFileError, version_entry
except ModuleNotFoundError as _err:
    _MISSING: ModuleNotFoundError | None = _err
else:
    _MISSING = None

console = Console(stderr=True)


def _steps(text: str) -> tuple[int, ...]:
    try:
        return check_steps(tuple(int(s) for s in text.split(",")))
    except (ValueError, PlanError) as err:
        raise argparse.ArgumentTypeError(f"--steps {text!r}: {err}") from None


def _window(text: str) -> str:
    try:
        duration_seconds(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--idle-window: {err}") from None
    return text


def _pair(flag: str):
    def parse(text: str) -> tuple[str, str]:
        key, sep, value = text.partition("=")
        if not sep or not key or not value:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected STACK=VALUE")
        return key, value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-serving rollout", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["start", "advance", "abort", "status"])
    parser.add_argument("model", help="model id, as in the stacks' llm-serving:models")
    parser.add_argument("--stacks", required=True,
                        help="comma-separated stacks in rollout order; the first is the first wave")
    parser.add_argument("--version", help="start: the version to roll out")
    parser.add_argument("--package", help="start: its package URI (default: from a stack that already lists it, "
                                          "else where `llm-serving publish` puts it in the stacks' home bucket)")
    parser.add_argument("--weights-gib", type=float, default=None,
                        help="start: the new version's weights in GiB (vllm models: the stack checks GPU fit and "
                             "load time with it)")
    parser.add_argument("--io-fingerprint", help="start: its I/O schema fingerprint (checked against the published "
                                                 "manifest before any stack changes, when the store is reachable)")
    parser.add_argument("--steps", type=_steps, default=DEFAULT_STEPS, help="red-black weights, e.g. 10,25,50,100")
    parser.add_argument("--surge", type=int, default=1, help="replicas a red-black update may add (default 1)")
    parser.add_argument("--first-wave", type=int, default=1, help="stacks in the first wave (default 1)")
    parser.add_argument("--prometheus", type=_pair("--prometheus"), action="append", default=[],
                        metavar="STACK=URL", help="Prometheus of a stack (default: its serving.prometheusAddress)")
    parser.add_argument("--no-gate", action="store_true", help="skip the analysis gate (updates still must succeed)")
    parser.add_argument("--max-error-ratio", type=float, default=GateThresholds.max_error_ratio)
    parser.add_argument("--max-latency", type=float, default=GateThresholds.max_latency_s, help="seconds")
    parser.add_argument("--quantile", type=float, default=GateThresholds.quantile)
    parser.add_argument("--window", default=GateThresholds.window, help="the gate's PromQL range, e.g. 10m")
    parser.add_argument("--min-requests", type=float, default=GateThresholds.min_requests)
    parser.add_argument("--bake", type=float, default=0.0, help="seconds to wait before each gate")
    parser.add_argument("--idle-window", type=_window, default="7d",
                        help="versioned: a version is removed only when Prometheus shows its pods scraped for this "
                             "whole range, its request counter present and no request served")
    parser.add_argument("--runner", choices=["automation", "mock", "rehearsal"], default="automation",
                        help="rehearsal: the mock runner's updates carried out by `make rehearse` on real pods and a "
                             "real proxy (its --control socket)")
    parser.add_argument("--control", type=Path, help="rehearsal runner: the rehearsal's control socket")
    parser.add_argument("--store-endpoint", default=None,
                        help="an S3-compatible endpoint holding the stacks' buckets (e.g. the rehearsal's): `start` "
                             "checks the package's replicas and I/O fingerprint there with any runner (the "
                             "automation runner always checks, against S3)")
    parser.add_argument("--project", type=Path, default=REPO_ROOT, help="the Pulumi project directory")
    parser.add_argument("--policy-pack", type=Path,
                        help="automation runner: the CrossGuard pack every `pulumi up` runs (default: the project's "
                             "policies/)")
    parser.add_argument("--config-dir", type=Path,
                        help="mock runner: the stack config files to edit (default: the project's stackConfigDir)")
    parser.add_argument("--state-dir", type=Path, default=REPO_ROOT / ".cache" / "rollout-mock",
                        help="mock runner: where each stack's simulated live state is kept")
    parser.add_argument("--mock-never-ready", type=_pair("--mock-never-ready"), action="append", default=[],
                        metavar="STACK=VERSION", help="mock runner: that version's pods never become ready there")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    return parser


def _runner(args: argparse.Namespace, policy_gate: PolicyGate | None):
    from infra.mockrun import Project

    if args.runner == "automation":
        if args.mock_never_ready or args.config_dir:
            raise RolloutError("--mock-never-ready and --config-dir only apply to --runner mock")
        if args.control is not None:
            raise RolloutError("--control only applies to --runner rehearsal")
        from infra.rollout.runner import AutomationRunner

        # The SDK hands over each line of the CLI's output without its newline. Every update runs the project's
        # CrossGuard pack (`pulumi up --policy-pack`), as the mock runner's updates run its rules offline.
        return AutomationRunner(args.project, on_output=lambda line: console.print(line, markup=False,
                                                                                     highlight=False),
                                policy_pack=args.policy_pack or args.project / "policies")
    from infra.rollout.runner import MockRunner, RehearsalRunner

    if args.policy_pack is not None:
        raise RolloutError("--policy-pack only applies to --runner automation (the other runners' updates are checked "
                           "by the policy gate `llm-serving rollout` passes)")

    if args.runner == "rehearsal":
        if args.control is None or args.config_dir is None:
            raise RolloutError("--runner rehearsal needs --control (the rehearsal's socket) and --config-dir (the "
                               "rehearsal's copy of the stack files)")
        if args.mock_never_ready:
            raise RolloutError("--mock-never-ready does not apply to --runner rehearsal: its pods are real")
        return RehearsalRunner(args.config_dir, args.state_dir, args.control, project_dir=args.project,
                               policy_gate=policy_gate)
    if args.control is not None:
        raise RolloutError("--control only applies to --runner rehearsal")
    if policy_gate is None:
        console.print("[yellow]warning:[/] no policy gate: the mock runner's updates are not checked against the "
                      "policy pack (`llm-serving rollout` checks them)")
    faults: dict[str, set] = {}
    for stack, version in args.mock_never_ready:
        faults.setdefault(stack, set()).add((args.model, version))
    return MockRunner(args.config_dir or Project.load(args.project).stacks_dir, args.state_dir,
                      {s: Faults(frozenset(v)) for s, v in faults.items()}, project_dir=args.project,
                      policy_gate=policy_gate)


def _replica_check(args: argparse.Namespace):
    """Where `start` checks the package (replicas, the published manifest's I/O fingerprint) before editing a stack."""
    if args.store_endpoint:
        import boto3

        return s3_replica_check(lambda region: boto3.client("s3", region_name=region,
                                                            endpoint_url=args.store_endpoint))
    return s3_replica_check() if args.runner == "automation" else None


def _version(args: argparse.Namespace, runner, stacks: list[str]) -> dict[str, str]:
    if not args.version:
        raise RolloutError("start needs --version")
    if args.package and not args.io_fingerprint:
        raise RolloutError("--package needs --io-fingerprint")
    if args.io_fingerprint:
        if args.package:
            return version_entry(args.version, args.package, args.io_fingerprint, args.weights_gib)
        # The key `llm-serving publish` writes (llm_serving.pod_contract), in the home region's bucket.
        typed = StackFile.load(runner.config_path(stacks[0])).typed()
        try:
            package = package_uri(typed.bucket_name(typed.home_region), typed.model_storage.model_prefix, args.model,
                                  args.version)
        except PodContractError as err:
            raise RolloutError(f"--version {args.version}: {err}") from None
        return version_entry(args.version, package, args.io_fingerprint, args.weights_gib)
    # Packages are published once (home region) and named alike in every stack: reuse another stack's entry.
    config_dir = runner.config_path(stacks[0]).parent
    for path in sorted(config_dir.glob("Pulumi.*.yaml")):
        for model in StackFile.load(path).typed().models:
            for v in model.versions if model.id == args.model else []:
                if v.version == args.version:
                    return version_entry(v.version, v.package, v.io_fingerprint, v.weights_gib)
    raise RolloutError(f"--version {args.version}: no stack in {config_dir} lists it; give --package and "
                       f"--io-fingerprint (a published package, docs/architecture.md §3.4)")


def _print_report(report: Report) -> None:
    table = Table(title=f"rollout {report.action} {report.model}")
    for col in ("stack", "status", "before", "after", "gate", "peak/bound", "detail"):
        table.add_column(col, overflow="fold")
    styles = {"rolled back": "red", "rollback failed": "bold red", "failed": "red", "not reached": "dim"}
    for s in report.stacks:
        peak = "" if s.peak_replicas is None else f"{s.peak_replicas}/{s.gpu_bound or '-'}"
        table.add_row(s.stack, f"[{styles.get(s.status, 'green')}]{s.status}[/]", s.before, s.after,
                      s.gate.describe() if s.gate else "", peak, s.detail)
    console.print(table)
    console.print("[green]done[/]" if report.ok else "[red]stopped: see the failed stack above; the stacks after it "
                  "were not touched, the ones before it keep their new step (`abort` rolls them back)[/]")


def main(argv: list[str] | None = None, *, policy_gate: PolicyGate | None = None) -> int:
    """The command; `policy_gate` checks each `--runner mock` update before any resource changes (None: no
    check). Injected by the caller above both planes, never imported here: see `PolicyGate`."""
    args = build_parser().parse_args(argv)
    if _MISSING is not None:
        console.print(f"[red]error:[/] `llm-serving rollout` runs in .venv-infra (`make infra-env`; "
                      f"{sys.executable} lacks {_MISSING.name!r})")
        return 2
    stacks = [s for s in args.stacks.split(",") if s]
    try:
        runner = _runner(args, policy_gate)
        clients = {}
        for stack in stacks:
            address = StackFile.load(runner.config_path(stack)).typed().serving.prometheus_address
            clients[stack] = PrometheusClient(address)
        for stack, url in args.prometheus:
            if stack not in stacks:
                raise RolloutError(f"--prometheus {stack}=...: {stack} is not in --stacks {stacks}")
            clients[stack] = PrometheusClient(url)
        thresholds = GateThresholds(args.max_error_ratio, args.max_latency, args.quantile, args.window,
                                    args.min_requests)
        options = Options(args.steps, args.surge, thresholds, args.bake, args.idle_window, args.first_wave)
        rollout = Rollout(runner, args.model, stacks, options,
                          gate=None if args.no_gate else prometheus_gate(
                              clients, thresholds,
                              lambda stack, model_id: StackFile.load(runner.config_path(stack)).model(model_id).kind),
                          prometheus=clients,
                          on_event=lambda msg: console.print(f"[cyan]>[/] {msg}", highlight=False),
                          # Against the real buckets for a real rollout, or any reachable store given; the mock
                          # runner's stacks have no buckets otherwise.
                          replicas=_replica_check(args))
        if args.action == "status":
            rows = rollout.status()
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                table = Table(title=f"rollout status {args.model}")
                for col in ("stack", "strategy", "config", "next", "deployed"):
                    table.add_column(col, overflow="fold")
                for r in rows:
                    table.add_row(r["stack"], r["strategy"], r["config"], r.get("next", ""),
                                  json.dumps(r["deployed"]) if r["deployed"] else r.get("deployedError",
                                                                                        "not recorded"))
                console.print(table)
            return 0
        if args.action == "start":
            report = rollout.start(_version(args, runner, stacks))
        elif args.action == "advance":
            report = rollout.advance()
        else:
            report = rollout.abort()
    except (RolloutError, StackFileError, ConfigError, PlanError, RunnerUnavailable) as err:
        console.print(f"[red]error:[/] {err}")
        return 2
    _print_report(report)
    if args.json:
        print(json.dumps(asdict(report) | {"ok": report.ok}, indent=2, default=str))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())  # no policy gate here (the mock runner warns): `llm-serving rollout` adds it
