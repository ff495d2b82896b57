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

from .._props import as_bool, as_list, as_number, get, iter_mappings, json_document
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
DRA = "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation"
BUCKET = "aws:s3/bucket:Bucket"
SSE_CONFIG = "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
KMS_KEY = "aws:kms/key:Key"
KMS_KEY_POLICY = "aws:kms/keyPolicy:KeyPolicy"
# The service-linked role FSx uses, per file system, to read its linked bucket (FSx for Lustre user guide, "Working
# with server-side encrypted Amazon S3 buckets").
FSX_S3_ROLE = "AWSServiceRoleForFSxS3Access_"


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


def _key_statements(index: StackIndex, key) -> list[Mapping[str, Any]]:
    docs = [get(key.props, "policy")]
    docs += [get(p.props, "policy") for p in index.of_type(KMS_KEY_POLICY)
             if index.referenced(p, (KMS_KEY,), "keyId", ("keyId",)) is key]
    out = []
    for doc in docs:
        parsed = json_document(doc)
        if isinstance(parsed, Mapping):
            out += [st for st in as_list(parsed.get("Statement")) if isinstance(st, Mapping)]
    return out


def _fsx_statement_problem(statement: Mapping[str, Any], bucket_arn: str, bucket_keys: bool) -> str | None:
    """None when the statement lets an FSx S3-access role decrypt through S3 for this bucket only; else why not.
    Not an FSx statement at all: the empty string."""
    principals = [str(p) for p in as_list(get(statement, "Principal", "AWS"))]
    if statement.get("Effect") != "Allow" or not any(FSX_S3_ROLE in p for p in principals):
        return ""
    actions = [str(a) for a in as_list(statement.get("Action"))]
    if not any(a in ("kms:Decrypt", "kms:*") for a in actions):
        return "does not allow kms:Decrypt"
    conditions: dict[str, Any] = {}
    for operator in (statement.get("Condition") or {}).values():
        if isinstance(operator, Mapping):
            conditions.update(operator)
    via = [str(v) for v in as_list(conditions.get("kms:ViaService"))]
    if not via or not all(v.startswith("s3.") for v in via):
        return "is not limited to calls through S3 (kms:ViaService s3.<region>.amazonaws.com)"
    wanted = bucket_arn if bucket_keys else f"{bucket_arn}/*"
    context = [str(v) for v in as_list(conditions.get("kms:EncryptionContext:aws:s3:arn"))]
    if context != [wanted]:
        return (f"is not limited to this bucket (kms:EncryptionContext:aws:s3:arn {context or 'unset'}, needs "
                f"[{wanted!r}]{' : S3 Bucket Keys are on, so S3 sends the bucket ARN' if bucket_keys else ''})")
    return None


def _validate_fsx_key_access(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    for dra in index.of_type(DRA):
        path = str(get(dra.props, "dataRepositoryPath") or "")
        bucket_name = path.removeprefix("s3://").split("/", 1)[0]
        bucket = next((b for b in index.of_type(BUCKET) if get(b.props, "bucket") == bucket_name), None)
        if not path.startswith("s3://") or bucket is None:
            continue  # a bucket outside this stack: its key is not reviewed here
        for sse in index.of_type(SSE_CONFIG):
            if get(sse.props, "bucket") != bucket_name and not index.depends_on(sse, bucket):
                continue
            for rule in iter_mappings(get(sse.props, "rules")):
                default = get(rule, "applyServerSideEncryptionByDefault") or {}
                if get(default, "sseAlgorithm") not in ("aws:kms", "aws:kms:dsse"):
                    continue  # SSE-S3: FSx reads it without any key policy
                key = index.referenced(sse, (KMS_KEY,), "rules", ("arn",))
                if key is None:
                    continue
                bucket_keys = as_bool(get(rule, "bucketKeyEnabled")) is True
                problems = [p for st in _key_statements(index, key)
                            if (p := _fsx_statement_problem(st, f"arn:aws:s3:::{bucket_name}", bucket_keys)) != ""]
                if None not in problems:
                    why = f": its FSx statement {problems[0]}" if problems else ""
                    report(f"data repository association {dra.name!r} links bucket {bucket_name!r}, encrypted with "
                           f"KMS key {key.name!r} whose policy does not let FSx's S3-access role "
                           f"({FSX_S3_ROLE}<file system id>) decrypt through S3 for this bucket only{why}: lazy loads "
                           f"of the model cache fail. Add that statement (infra/storage.py) or use SSE-S3", dra.urn)
                    continue
                policies = [p for p in index.of_type(KMS_KEY_POLICY)
                            if index.referenced(p, (KMS_KEY,), "keyId", ("keyId",)) is key]
                if policies and not any(index.depends_on(dra, p) for p in policies):
                    report(f"data repository association {dra.name!r} does not depend on the key policy of "
                           f"{key.name!r}: Pulumi may create it (and FSx import from the bucket) before FSx may "
                           f"decrypt", dra.urn)


fsx_s3_key_access = StackValidationPolicy(
    name="fsx-s3-key-access",
    description="An SSE-KMS bucket linked to FSx for Lustre has a key policy letting FSx's S3-access role decrypt "
                "through S3 for that bucket only, in place before the data repository association.",
    validate=_validate_fsx_key_access,
    enforcement_level=EnforcementLevel.MANDATORY,
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

POLICIES = [fsx_persistent_2_in_prod, fsx_encryption, fsx_lustre_ports_only, fsx_s3_key_access]
