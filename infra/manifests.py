"""The Kubernetes manifests a stack would apply, taken from its mock run, and their checks:

- `kubernetes-validate` against the Kubernetes OpenAPI schema of the cluster's version (strict: unknown fields are
  errors), for every built-in kind;
- custom resources (Gateway API, KEDA, Prometheus Operator) have no schema in Kubernetes' OpenAPI document: they
  are checked against their CRDs' JSON schemas by `infra/crd_validate/validate.mjs` (the validators
  @kubernetes-models generates from the upstream CRDs; pinned in its package.json, installed by the Makefile with
  `npm ci`);
- checkov's Kubernetes checks (run by `infra.plan` in its own environment), with suppressions only from
  `infra/checkov_suppressions.yaml`, each with a written reason.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra.mockrun import MockedResource, StackRun

CRD_VALIDATOR = Path(__file__).resolve().parent / "crd_validate" / "validate.mjs"
BUILTIN_GROUPS = ("", "apps", "batch", "policy", "autoscaling", "networking.k8s.io", "rbac.authorization.k8s.io",
                  "storage.k8s.io", "scheduling.k8s.io", "admissionregistration.k8s.io", "apiextensions.k8s.io")
# Resources that are Kubernetes objects but not manifests the cluster stores as such.
NOT_MANIFESTS = ("pulumi:providers:kubernetes", "kubernetes:helm.sh/v3:Release")


@dataclass(frozen=True)
class Manifest:
    stack: str
    resource: str  # the Pulumi resource name
    kind: str
    api_version: str
    name: str
    namespace: str | None
    body: dict[str, Any]

    @property
    def file_name(self) -> str:
        slug = re.sub(r"[^a-z0-9.-]", "-", f"{self.kind}-{self.namespace or 'cluster'}-{self.name}".lower())
        return f"{slug}.yaml"


def is_manifest(resource: MockedResource) -> bool:
    return resource.type.startswith("kubernetes:") and resource.type not in NOT_MANIFESTS and resource.custom


def manifests(run: StackRun) -> list[Manifest]:
    out = []
    for r in run.resources:
        if not is_manifest(r):
            continue
        body = dict(r.inputs)
        meta = body.get("metadata") or {}
        if "apiVersion" not in body or "kind" not in body:
            raise ValueError(f"{run.stack}: {r.type} {r.name} has no apiVersion/kind in its inputs")
        out.append(Manifest(stack=run.stack, resource=r.name, kind=body["kind"], api_version=body["apiVersion"],
                            name=meta.get("name", r.name), namespace=meta.get("namespace"), body=body))
    return out


def write_manifests(items: list[Manifest], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for m in items:
        path = directory / m.file_name
        path.write_text(yaml.safe_dump(m.body, sort_keys=False))
        paths.append(path)
    return paths


@dataclass(frozen=True)
class SchemaFinding:
    manifest: Manifest
    message: str


def is_builtin(m: Manifest) -> bool:
    group = m.api_version.split("/")[0] if "/" in m.api_version else ""
    return group in BUILTIN_GROUPS


def validate_builtin(m: Manifest, kubernetes_version: str) -> list[SchemaFinding]:
    """Strict validation against Kubernetes' OpenAPI schema of the cluster's version (unknown fields are errors)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(m.body, f"{kubernetes_version}.0", strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(str(p) for p in exc.path) or "<root>"
        return [SchemaFinding(m, f"{path}: {exc.message}")]
    except kubernetes_validate.SchemaNotFoundError:
        return [SchemaFinding(m, f"no schema for {m.api_version} {m.kind} in Kubernetes {kubernetes_version}")]
    return []


def validate_custom(items: list[Manifest], node: str = "node") -> list[SchemaFinding]:
    """Custom resources against their CRDs' schemas, all in one Node process."""
    if not items:
        return []
    if not (CRD_VALIDATOR.parent / "node_modules").is_dir():
        raise RuntimeError(f"{CRD_VALIDATOR.parent}/node_modules is missing: run `npm ci --prefix "
                           f"{CRD_VALIDATOR.parent.relative_to(CRD_VALIDATOR.parents[2])}` (make plan does)")
    proc = subprocess.run([node, str(CRD_VALIDATOR)], input=json.dumps([m.body for m in items]),
                          capture_output=True, text=True, timeout=120, cwd=CRD_VALIDATOR.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"{CRD_VALIDATOR.name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return [SchemaFinding(items[r["index"]], err) for r in json.loads(proc.stdout) for err in r["errors"]]


def validate_manifests(items: list[Manifest], kubernetes_version: str) -> list[SchemaFinding]:
    findings = [f for m in items if is_builtin(m) for f in validate_builtin(m, kubernetes_version)]
    return findings + validate_custom([m for m in items if not is_builtin(m)])


@dataclass(frozen=True)
class Suppression:
    check: str
    reason: str
    kinds: tuple[str, ...]
    names: tuple[str, ...]

    def covers(self, check_id: str, kind: str, name: str) -> bool:
        return (check_id == self.check and (not self.kinds or kind in self.kinds)
                and (not self.names or any(re.fullmatch(p, name) for p in self.names)))


def load_suppressions(path: Path) -> list[Suppression]:
    doc = yaml.safe_load(path.read_text()) or {}
    out = []
    for i, item in enumerate(doc.get("suppressions") or []):
        reason = str(item.get("reason") or "").strip()
        if len(reason) < 20:
            raise ValueError(f"{path}: suppressions[{i}] ({item.get('check')}) needs a written reason")
        out.append(Suppression(check=item["check"], reason=reason, kinds=tuple(item.get("kinds") or ()),
                               names=tuple(item.get("names") or ())))
    return out
