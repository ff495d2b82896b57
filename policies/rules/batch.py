"""The batch path's client data stays where it belongs (docs/batch.md, infra/batch.py).

- A batch bucket (one whose name ends in `-batch`) is never the source of a replication rule nor an FSx data
  repository association's path: client files and results stay in their region and never appear on the model
  cache every pod mounts.
- A batch worker's role (the IRSA role of a `<model>-batch-worker` service account) grants S3 only on its own
  model's prefix of a batch bucket (`<bucket>/<model>/*`, and listing under that prefix): it cannot read the model
  bucket, another model's batches, or any other prefix.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pulumi_policy import EnforcementLevel, ReportViolation, StackValidationArgs, StackValidationPolicy

from .._props import as_list, get, iter_mappings, json_document
from ..index import StackIndex
from .s3 import BUCKET_TYPES, REPLICATION_TYPES

BATCH_SUFFIX = "-batch"
WORKER_SUFFIX = "-batch-worker"
ROLE = "aws:iam/role:Role"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
ASSOCIATION = "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation"


def _batch_buckets(index: StackIndex) -> dict[str, Any]:
    return {str(get(b.props, "bucket")): b for b in index.of_type(*BUCKET_TYPES)
            if str(get(b.props, "bucket") or "").endswith(BATCH_SUFFIX)}


def _worker_models(role_props: Any) -> list[str]:
    """The models whose batch worker's service account may assume this role (IRSA trust `:sub` conditions)."""
    models = []
    trust = json_document(get(role_props, "assumeRolePolicy")) or {}
    for statement in iter_mappings(trust.get("Statement")):
        for key, value in (get(statement, "Condition", "StringEquals") or {}).items():
            for subject in as_list(value):
                account = str(subject).rsplit(":", 1)[-1]
                if key.endswith(":sub") and account.endswith(WORKER_SUFFIX):
                    models.append(account.removesuffix(WORKER_SUFFIX))
    return models


def worker_statement_problems(statement: Any, model: str, buckets: Iterable[str]) -> list[str]:
    """What an Allow statement of a batch worker's role grants beyond its model's prefix of a batch bucket."""
    if get(statement, "Effect") != "Allow":
        return []
    actions = [str(a) for a in as_list(get(statement, "Action"))]
    if not any(a.startswith("s3:") or a == "*" for a in actions):
        return []
    allowed = {f"arn:aws:s3:::{b}/{model}/*" for b in buckets} | {f"arn:aws:s3:::{b}" for b in buckets}
    problems = [f"grants {', '.join(actions)} on {r}, outside {model}'s prefix of the batch bucket"
                for r in map(str, as_list(get(statement, "Resource"))) if r not in allowed]
    if any(r in {f"arn:aws:s3:::{b}" for b in buckets} for r in map(str, as_list(get(statement, "Resource")))):
        prefixes = as_list(get(statement, "Condition", "StringLike", "s3:prefix"))
        if not prefixes or any(str(p) != f"{model}/*" for p in prefixes):
            problems.append(f"lists the batch bucket beyond {model}/ (s3:prefix {prefixes or 'unrestricted'})")
    return problems


def _validate(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    buckets = _batch_buckets(index)
    for name, bucket in buckets.items():
        for replication in index.of_type(*REPLICATION_TYPES):
            if index.referenced(replication, BUCKET_TYPES, "bucket", ("bucket",)) is bucket:
                report(f"batch bucket {name!r} is replicated by {replication.name!r}: client data must stay in its "
                       "region (docs/batch.md)", replication.urn)
        for association in index.of_type(ASSOCIATION):
            path = str(get(association.props, "dataRepositoryPath") or "")
            if path.removeprefix("s3://").split("/", 1)[0] == name:
                report(f"batch bucket {name!r} is FSx data repository association {association.name!r}'s path: "
                       "client data would be on every model pod's file system", association.urn)
    for role in index.of_type(ROLE):
        for model in _worker_models(role.props):
            for policy in index.of_type(ROLE_POLICY):
                if index.referenced(policy, (ROLE,), "role", ("name", "id")) is not role:
                    continue
                document = json_document(get(policy.props, "policy")) or {}
                for statement in iter_mappings(document.get("Statement")):
                    for problem in worker_statement_problems(statement, model, buckets):
                        report(f"batch worker role {role.name!r} ({model}): {problem}", policy.urn)


batch_store_isolated = StackValidationPolicy(
    name="batch-store-isolated",
    description="A batch bucket never replicates nor backs the model cache; a batch worker's role reaches only its "
                "own model's prefix of it.",
    enforcement_level=EnforcementLevel.MANDATORY,
    validate=_validate,
)

POLICIES = [batch_store_isolated]
