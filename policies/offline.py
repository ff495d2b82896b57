"""Run the policy pack's rules offline over each stack's mock run: `python -m policies.offline [--stack X ...]`.

`pulumi preview --policy-pack policies` needs the Pulumi CLI and a cloud account; neither exists in CI. This runner
gives the real rule objects (the same module-level policies the pack holds) what the CLI's analyzer would give them:
each resource of `infra.mockrun.run_stack(stack)` becomes a `ResourceValidationArgs` and a `PolicyResource` (with
its parent, dependencies, provider and custom timeouts), and the stack's config travels as the policy config (see
`policies.context`). It prints one table per stack (policy, enforcement, resource, message) and exits 1 when any
mandatory policy is violated, or when a rule itself fails: a rule that crashes has not checked anything.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from inspect import isawaitable
from pathlib import Path
from typing import Any, Protocol

from pulumi_policy import (
    EnforcementLevel,
    Policy,
    PolicyCustomTimeouts,
    PolicyProviderResource,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.policy import _NotApplicableError
from pulumi_policy.proxy import unknown_checking_proxy

from ._props import duration_seconds
from .catalog import ALL_POLICIES, enforcement
from .context import offline_policy_config

MANDATORY = EnforcementLevel.MANDATORY.value
ADVISORY = EnforcementLevel.ADVISORY.value
ERROR = "error"
NOT_APPLICABLE = "not applicable"


class ResourceLike(Protocol):
    """What `infra.mockrun.MockedResource` provides (and the tests' synthetic resources)."""

    type: str
    name: str
    urn: str
    inputs: dict
    parent: str | None
    dependencies: list[str]
    custom_timeouts: dict | None
    provider: str | None


@dataclass(frozen=True)
class Finding:
    stack: str
    policy: str
    # "mandatory", "advisory", "error" (the rule raised) or "not applicable" (a stack policy that could not apply,
    # with its reason: shown in the report, never blocking)
    enforcement: str
    resource: str  # the resource's logical name, or "(stack)"
    resource_type: str
    urn: str | None
    message: str

    @property
    def blocking(self) -> bool:
        return self.enforcement in (MANDATORY, ERROR)


def _timeouts(raw: Mapping[str, Any] | None) -> PolicyCustomTimeouts:
    # The engine hands analyzers seconds (0 when unset); the mock runtime records Pulumi's duration strings.
    raw = raw or {}
    return PolicyCustomTimeouts(*(duration_seconds(raw.get(k)) or 0.0 for k in ("create", "update", "delete")))


def _provider_urn(ref: str | None) -> str | None:
    # A provider reference is "<provider urn>::<provider id>".
    return ref.rsplit("::", 1)[0] if ref else None


def _decoded(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def to_policy_resources(resources: Sequence[ResourceLike]) -> list[PolicyResource]:
    """The analyzer's view of the stack: PolicyResources linked to their parents and dependencies."""
    # Props wrapped exactly as the CLI's analyzer wraps them, so rules meet the same Mapping/Sequence proxies here
    # as under `pulumi preview`.
    providers = {
        r.urn: PolicyProviderResource(
            r.type, unknown_checking_proxy({k: _decoded(v) for k, v in r.inputs.items()}), r.urn, r.name
        )
        for r in resources
        if r.type.startswith("pulumi:providers:")
    }
    out = [
        PolicyResource(
            resource_type=r.type,
            props=unknown_checking_proxy(copy.deepcopy(r.inputs)),
            urn=r.urn,
            name=r.name,
            opts=PolicyResourceOptions(False, [], None, [], _timeouts(r.custom_timeouts), [], r.parent),
            provider=providers.get(_provider_urn(r.provider)),
            parent=None,
            dependencies=[],
            property_dependencies={},
        )
        for r in resources
    ]
    by_urn = {p.urn: p for p in out}
    for source, target in zip(resources, out, strict=True):
        target.parent = by_urn.get(source.parent) if source.parent else None
        target.dependencies = [by_urn[u] for u in source.dependencies if u in by_urn]
        prop_deps = getattr(source, "property_dependencies", None) or {}
        target.property_dependencies = {k: [by_urn[u] for u in v if u in by_urn] for k, v in prop_deps.items()}
    return out


def _run(result: Any) -> None:
    if isawaitable(result):
        asyncio.new_event_loop().run_until_complete(result)


def evaluate(
    resources: Sequence[ResourceLike],
    stack: str,
    project: str = "llm-serving",
    config: Mapping[str, Any] | None = None,
    policies: Iterable[Policy] = ALL_POLICIES,
    compat_file: str | Path | None = None,
) -> list[Finding]:
    """Every violation the policies report on one stack's resources."""
    policy_config = offline_policy_config(stack, project, config or {})
    if compat_file is not None:
        policy_config["compatFile"] = str(compat_file)
    stack_resources = to_policy_resources(resources)
    raw_inputs = {r.urn: r.inputs for r in resources}
    findings: list[Finding] = []

    for policy in policies:
        level = enforcement(policy).value
        if level == EnforcementLevel.DISABLED.value:
            continue

        def reporter(subject: PolicyResource | None, policy=policy, level=level):
            def report(message: str, urn: str | None = None) -> None:
                target = next((r for r in stack_resources if r.urn == urn), None) if urn else subject
                findings.append(Finding(
                    stack=stack,
                    policy=policy.name,
                    enforcement=level,
                    resource=target.name if target else "(stack)",
                    resource_type=target.resource_type if target else "",
                    urn=target.urn if target else None,
                    message=message,
                ))
            return report

        def crashed(subject: PolicyResource | None, err: Exception, policy=policy) -> None:
            findings.append(Finding(
                stack=stack, policy=policy.name, enforcement=ERROR,
                resource=subject.name if subject else "(stack)",
                resource_type=subject.resource_type if subject else "",
                urn=subject.urn if subject else None,
                # UnknownValueError keeps its text in .message (its str() is empty).
                message=f"the rule raised {type(err).__name__}: {getattr(err, 'message', None) or err}",
            ))

        if isinstance(policy, ResourceValidationPolicy):
            for res in stack_resources:
                args = ResourceValidationArgs(
                    res.resource_type, unknown_checking_proxy(copy.deepcopy(raw_inputs[res.urn])), res.urn,
                    res.name, res.opts, res.provider, copy.deepcopy(policy_config),
                )
                try:
                    _run(policy.validate(args, reporter(res)))
                except _NotApplicableError:
                    continue
                except Exception as err:  # reported as a blocking finding, never swallowed
                    crashed(res, err)
        elif isinstance(policy, StackValidationPolicy):
            args = StackValidationArgs(stack_resources, copy.deepcopy(policy_config))
            try:
                _run(policy.validate(args, reporter(None)))
            except _NotApplicableError as why:
                findings.append(Finding(stack=stack, policy=policy.name, enforcement=NOT_APPLICABLE,
                                        resource="(stack)", resource_type="", urn=None,
                                        message=why.reason or "the policy does not apply to this stack"))
            except Exception as err:
                crashed(None, err)
        else:
            raise TypeError(f"policy {policy.name!r} is neither a resource nor a stack validation policy")
    return findings


def render(findings: Sequence[Finding], stack: str, resource_count: int, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    blocking = sum(f.blocking for f in findings)
    advisory = sum(f.enforcement == ADVISORY for f in findings)
    skipped = sum(f.enforcement == NOT_APPLICABLE for f in findings)
    title = (f"policy report: {stack} ({resource_count} resources, {len(ALL_POLICIES)} policies, "
             f"{blocking} blocking, {advisory} advisory" + (f", {skipped} not applicable)" if skipped else ")"))
    if not findings:
        console.print(f"[bold green]{title}: every policy passes[/]")
        return
    table = Table(title=title, show_lines=True, expand=True)
    table.add_column("policy", style="bold", overflow="fold")
    table.add_column("enforcement", overflow="fold")
    table.add_column("resource", overflow="fold")
    table.add_column("message", overflow="fold", ratio=3)
    style = {MANDATORY: "bold red", ERROR: "bold magenta", NOT_APPLICABLE: "dim"}
    order = {ERROR: 0, MANDATORY: 0, ADVISORY: 1, NOT_APPLICABLE: 2}
    for f in sorted(findings, key=lambda f: (order.get(f.enforcement, 1), f.policy, f.resource)):
        table.add_row(f.policy, f"[{style.get(f.enforcement, 'yellow')}]{f.enforcement}[/]",
                      f"{f.resource}\n[dim]{f.resource_type}[/]" if f.resource_type else f.resource, f.message)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Evaluate the policy pack on each stack's mock run.")
    parser.add_argument("--stack", action="append", help="a stack to check (repeatable); default: every shipped stack")
    parser.add_argument("--compat-file", type=Path, help="compat.toml to check pins against (default: the image's)")
    parser.add_argument("--json", type=Path, help="also write every finding as JSON to this file")
    args = parser.parse_args(argv)

    from infra.mockrun import run_stack, shipped_stacks

    stacks = args.stack or shipped_stacks()
    if not stacks:
        print("no stacks to check: stacks/ has no Pulumi.<stack>.yaml", file=sys.stderr)
        return 2
    all_findings: list[Finding] = []
    failed_runs = []
    for stack in stacks:
        try:
            run = run_stack(stack)
        except Exception as err:  # a stack that does not even run cannot pass
            print(f"{stack}: the mock run failed: {err}", file=sys.stderr)
            failed_runs.append(stack)
            continue
        findings = evaluate(run.resources, run.stack, run.project, run.config, compat_file=args.compat_file)
        render(findings, stack, len(run.resources))
        all_findings.extend(findings)
    if args.json:
        args.json.write_text(json.dumps([asdict(f) for f in all_findings], indent=2))
    blocking = [f for f in all_findings if f.blocking]
    advisory = sum(f.enforcement == ADVISORY for f in all_findings)
    skipped = sum(f.enforcement == NOT_APPLICABLE for f in all_findings)
    print(f"{len(stacks)} stack(s): {len(blocking)} blocking finding(s), {advisory} advisory, "
          f"{skipped} not applicable, {len(failed_runs)} failed run(s)")
    return 1 if blocking or failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
