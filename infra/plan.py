"""`make plan`: preview every shipped stack offline (docs/architecture.md §3.1).

For each stack in stacks/: run the program under Pulumi's mock runtime (infra.mockrun), print a table of the
resources it would create, write them all as JSON, write every Kubernetes manifest it would apply, validate the
manifests against the Kubernetes OpenAPI schema (kubernetes-validate) and the custom resources against their CRDs'
schemas, and run checkov's Kubernetes checks (suppressions only from infra/checkov_suppressions.yaml, each with a
reason). Exits non-zero when a stack fails to run, a manifest is invalid, or checkov has an unsuppressed failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from infra.manifests import Manifest, Suppression, load_suppressions, manifests, validate_manifests, write_manifests
from infra.mockrun import REPO_ROOT, StackRun, run_stack, shipped_stacks

DEFAULT_OUT = REPO_ROOT / "build" / "plan"
SUPPRESSIONS = REPO_ROOT / "infra" / "checkov_suppressions.yaml"
DEFAULT_CHECKOV = REPO_ROOT / ".venv-checkov" / "bin" / "checkov"


@dataclass
class CheckovFinding:
    stack: str
    check_id: str
    check_name: str
    resource: str
    file: str
    suppressed_by: str | None = None


@dataclass
class StackReport:
    stack: str
    run: StackRun | None = None
    error: str | None = None
    manifests: list[Manifest] = field(default_factory=list)
    schema_errors: list[str] = field(default_factory=list)
    checkov: list[CheckovFinding] = field(default_factory=list)
    checkov_passed: int = 0


def resource_table(run: StackRun) -> Table:
    table = Table(title=f"{run.stack}: {len(run.resources)} resources", show_lines=False, expand=False)
    table.add_column("type", style="cyan", no_wrap=True)
    table.add_column("#", justify="right")
    table.add_column("names")
    table.add_column("custom timeouts", style="magenta")
    by_type: dict[str, list] = defaultdict(list)
    for r in run.resources:
        by_type[r.type].append(r)
    for typ in sorted(by_type):
        items = by_type[typ]
        timeouts = sorted({json.dumps(r.custom_timeouts, sort_keys=True) for r in items if r.custom_timeouts})
        table.add_row(typ, str(len(items)), ", ".join(sorted(r.name for r in items)),
                      "\n".join(t.replace('"', "") for t in timeouts))
    return table


def models_table(run: StackRun) -> Table:
    table = Table(title=f"{run.stack}: models")
    for col in ("model", "strategy", "versions", "active", "route weights", "replicas", "OpenAI endpoint"):
        table.add_column(col)
    for model_id, m in sorted(run.outputs.get("models", {}).items()):
        table.add_row(model_id, m["strategy"], ", ".join(m["versions"]), m["activeVersion"],
                      ", ".join(f"{v}={w}" for v, w in m["routeWeights"].items()),
                      ", ".join(f"{v}={n}" for v, n in m["replicas"].items()), m["endpoints"]["openai"])
    return table


def run_checkov(checkov: Path, manifest_dir: Path, suppressions: list[Suppression]) -> tuple[list[CheckovFinding],
                                                                                                 dict[str, int]]:
    if not checkov.exists():
        raise FileNotFoundError(f"checkov not found at {checkov} (make plan installs it in .venv-checkov)")
    proc = subprocess.run(
        [str(checkov), "-d", str(manifest_dir), "--framework", "kubernetes", "--compact",
         "--skip-download", "-o", "json"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise RuntimeError(f"checkov failed ({proc.returncode}): {proc.stderr[-3000:]}")
    doc = json.loads(proc.stdout)
    reports = doc if isinstance(doc, list) else [doc]
    findings, passed = [], defaultdict(int)
    for report in reports:
        if report.get("summary", {}).get("parsing_errors"):
            raise RuntimeError(f"checkov could not parse {report['summary']['parsing_errors']} manifest(s)")
        results = report.get("results", {})
        for item in results.get("passed_checks", []):
            passed[item["file_path"].strip("/").split("/")[0]] += 1
        for item in results.get("failed_checks", []):
            kind, _, rest = item["resource"].partition(".")
            name = rest.split(".", 1)[-1]
            stack = item["file_path"].strip("/").split("/")[0]
            rule = next((s for s in suppressions if s.covers(item["check_id"], kind, name)), None)
            findings.append(CheckovFinding(stack=stack, check_id=item["check_id"], check_name=item["check_name"],
                                           resource=item["resource"], file=item["file_path"],
                                           suppressed_by=rule.reason if rule else None))
    return findings, dict(passed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", action="append", help="a stack to plan (repeatable); default: every shipped stack")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON and the manifests go")
    parser.add_argument("--checkov", type=Path, default=Path(os.environ.get("CHECKOV", DEFAULT_CHECKOV)))
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 160))

    stacks = args.stack or shipped_stacks()
    if not stacks:
        console.print("[red]no stacks: stacks/ has no Pulumi.<stack>.yaml[/]")
        return 2
    if args.out.exists():
        shutil.rmtree(args.out)
    manifest_dir = args.out / "manifests"
    reports = {s: StackReport(s) for s in stacks}

    def run_one(stack: str) -> None:
        try:
            reports[stack].run = run_stack(stack)
        except Exception as exc:  # reported per stack; one broken stack must not hide the others
            reports[stack].error = f"{type(exc).__name__}: {exc}"

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(run_one, stacks))

    for report in reports.values():
        if report.run is None:
            continue
        console.print(resource_table(report.run))
        if report.run.outputs.get("models"):
            console.print(models_table(report.run))
        report.manifests = manifests(report.run)
        write_manifests(report.manifests, manifest_dir / report.stack)
        version = report.run.config.get("llm-serving:cluster", {}).get("kubernetesVersion", "1.33")
        report.schema_errors = [f"{f.manifest.kind} {f.manifest.name}: {f.message}"
                                for f in validate_manifests(report.manifests, str(version))]

    suppressions = load_suppressions(SUPPRESSIONS)
    checkov_error = None
    if any(r.manifests for r in reports.values()):
        try:
            findings, passed = run_checkov(args.checkov, manifest_dir, suppressions)
            for f in findings:
                reports[f.stack].checkov.append(f)
            for stack, n in passed.items():
                reports[stack].checkov_passed = n
        except (RuntimeError, FileNotFoundError) as exc:
            checkov_error = str(exc)

    summary = Table(title="make plan")
    for col in ("stack", "resources", "k8s manifests", "schema errors", "checkov passed", "checkov failed",
                "suppressed", "result"):
        summary.add_column(col)
    failed = bool(checkov_error)
    for r in reports.values():
        open_findings = [f for f in r.checkov if not f.suppressed_by]
        ok = r.run is not None and not r.schema_errors and not open_findings
        failed |= not ok
        summary.add_row(r.stack, str(len(r.run.resources)) if r.run else "-", str(len(r.manifests)),
                        str(len(r.schema_errors)), str(r.checkov_passed), str(len(open_findings)),
                        str(len(r.checkov) - len(open_findings)), "[green]ok[/]" if ok else "[red]FAILED[/]")
    console.print(summary)

    for r in reports.values():
        if r.error:
            console.print(f"[red]{r.stack}: the mock run failed:[/] {r.error}")
        for e in r.schema_errors:
            console.print(f"[red]{r.stack}: schema:[/] {e}")
        for f in r.checkov:
            if not f.suppressed_by:
                console.print(f"[red]{r.stack}: checkov {f.check_id}[/] {f.check_name}: {f.resource}")
    if checkov_error:
        console.print(f"[red]checkov:[/] {checkov_error}")
    used = {(f.check_id, f.suppressed_by) for r in reports.values() for f in r.checkov if f.suppressed_by}
    for s in suppressions:
        if (s.check, s.reason) not in used:
            console.print(f"[yellow]suppression {s.check} ({', '.join(s.kinds)}) matched nothing: delete it[/]")

    args.out.mkdir(parents=True, exist_ok=True)
    plan_json = args.out / "plan.json"
    plan_json.write_text(json.dumps({
        r.stack: {
            "error": r.error,
            "run": asdict(r.run) if r.run else None,
            "manifests": [m.file_name for m in r.manifests],
            "schemaErrors": r.schema_errors,
            "checkov": [asdict(f) for f in r.checkov],
        } for r in reports.values()
    }, indent=2, sort_keys=True, default=str))
    console.print(f"plan JSON: {plan_json.relative_to(REPO_ROOT) if plan_json.is_relative_to(REPO_ROOT) else plan_json}"
                  f"; manifests under {manifest_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
