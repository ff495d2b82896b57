"""FSx for Lustre, the model cache: durable in prod, encrypted, and reachable only on the Lustre ports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from .._props import as_list, as_number, get, iter_mappings
from ..context import stack_context
from ..index import StackIndex

LUSTRE = "aws:fsx/lustreFileSystem:LustreFileSystem"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"
SG_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
SG_INGRESS_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
# TCP 988 (LNet) and 1018-1023 (Lustre servers), per the FSx for Lustre user guide; nothing else.
LUSTRE_PORTS = frozenset({988, *range(1018, 1024)})
OPEN_WORLD = ("0.0.0.0/0", "::/0")
PERSISTENT = ("PERSISTENT_1", "PERSISTENT_2")


def _validate_deployment_type(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != LUSTRE:
        return
    ctx = stack_context(args)
    kind = get(args.props, "deploymentType") or "SCRATCH_1"  # the AWS default when unset
    if ctx.is_prod and kind != "PERSISTENT_2":
        report(
            f"FSx for Lustre {args.name!r} is {kind} in prod stack {ctx.stack!r}: prod model caches must be "
            f"PERSISTENT_2 (scratch file systems lose data when a server fails; PERSISTENT_1 lacks PERSISTENT_2's "
            f"throughput tiers and S3 association support)",
            None,
        )


def _validate_encryption(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != LUSTRE:
        return
    kind = get(args.props, "deploymentType") or "SCRATCH_1"
    if kind == "SCRATCH_1":
        report(f"FSx for Lustre {args.name!r} is SCRATCH_1, which is not encrypted at rest: use PERSISTENT_2", None)
    elif kind in PERSISTENT and not get(args.props, "kmsKeyId"):
        report(
            f"FSx for Lustre {args.name!r} ({kind}) has no kmsKeyId: encrypt the model cache with the stack's "
            f"customer-managed KMS key, as the bucket it mirrors is",
            None,
        )


def _port_problem(protocol: Any, from_port: Any, to_port: Any) -> str | None:
    proto = str(protocol).lower() if protocol is not None else None
    if proto in ("-1", "all"):
        return "all protocols and ports"
    if proto not in ("tcp", "6"):
        return f"protocol {protocol!r}"
    low, high = as_number(from_port), as_number(to_port)
    if low is None or high is None:
        return "an unspecified port range"
    ports = set(range(int(low), int(high) + 1))
    extra = ports - LUSTRE_PORTS
    if extra:
        return f"TCP {int(low)}-{int(high)}" if low != high else f"TCP {int(low)}"
    return None


def _rules_of(index: StackIndex, sg) -> list[tuple[str, Mapping[str, Any]]]:
    """Every ingress rule that applies to `sg`: inline, SecurityGroupRule (type ingress) and SecurityGroupIngressRule,
    normalised to {protocol, fromPort, toPort, cidrs}."""
    out = []
    for rule in iter_mappings(get(sg.props, "ingress")):
        out.append((f"{sg.name} (inline)", {
            "protocol": rule.get("protocol"), "fromPort": rule.get("fromPort"), "toPort": rule.get("toPort"),
            "cidrs": as_list(rule.get("cidrBlocks")) + as_list(rule.get("ipv6CidrBlocks")),
        }))
    for rule in index.of_type(SG_RULE):
        if get(rule.props, "type") != "ingress":
            continue
        if sg not in index.references(rule, (SECURITY_GROUP,), "securityGroupId", ("name",)):
            continue
        out.append((rule.name, {
            "protocol": get(rule.props, "protocol"), "fromPort": get(rule.props, "fromPort"),
            "toPort": get(rule.props, "toPort"),
            "cidrs": as_list(get(rule.props, "cidrBlocks")) + as_list(get(rule.props, "ipv6CidrBlocks")),
        }))
    for rule in index.of_type(SG_INGRESS_RULE):
        if sg not in index.references(rule, (SECURITY_GROUP,), "securityGroupId", ("name",)):
            continue
        out.append((rule.name, {
            "protocol": get(rule.props, "ipProtocol"), "fromPort": get(rule.props, "fromPort"),
            "toPort": get(rule.props, "toPort"),
            "cidrs": as_list(get(rule.props, "cidrIpv4")) + as_list(get(rule.props, "cidrIpv6")),
        }))
    return out


def _validate_ports(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    groups = index.of_type(SECURITY_GROUP)
    for fs in index.of_type(LUSTRE):
        attached = [sg for sg in groups if index.depends_on(fs, sg)]
        if not attached:
            report(
                f"FSx for Lustre {fs.name!r} uses no security group created in this stack (securityGroupIds "
                f"{as_list(get(fs.props, 'securityGroupIds'))}): give it its own group that opens only TCP 988 and "
                f"1018-1023 to the nodes, so its ports can be checked",
                fs.urn,
            )
        for sg in attached:
            for source, rule in _rules_of(index, sg):
                problem = _port_problem(rule["protocol"], rule["fromPort"], rule["toPort"])
                if problem:
                    report(
                        f"FSx for Lustre {fs.name!r}: security group {sg.name!r} rule {source!r} opens {problem}; "
                        f"only TCP 988 and 1018-1023 may be open",
                        sg.urn,
                    )
                world = [c for c in rule["cidrs"] if c in OPEN_WORLD]
                if world:
                    report(
                        f"FSx for Lustre {fs.name!r}: security group {sg.name!r} rule {source!r} is open to "
                        f"{', '.join(world)}; allow the node security group or the VPC's private ranges only",
                        sg.urn,
                    )


fsx_persistent_2_in_prod = ResourceValidationPolicy(
    name="fsx-persistent-2-in-prod",
    description="FSx for Lustre file systems in prod stacks use the PERSISTENT_2 deployment type.",
    validate=_validate_deployment_type,
    enforcement_level=EnforcementLevel.MANDATORY,
)
fsx_encryption = ResourceValidationPolicy(
    name="fsx-encryption",
    description="FSx for Lustre file systems are encrypted at rest with a customer-managed KMS key.",
    validate=_validate_encryption,
    enforcement_level=EnforcementLevel.MANDATORY,
)
fsx_lustre_ports_only = StackValidationPolicy(
    name="fsx-lustre-ports-only",
    description="FSx for Lustre security groups open only TCP 988 and 1018-1023, never to the whole internet.",
    validate=_validate_ports,
    enforcement_level=EnforcementLevel.MANDATORY,
)

POLICIES = [fsx_persistent_2_in_prod, fsx_encryption, fsx_lustre_ports_only]
