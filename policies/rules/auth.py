"""Caller authentication (docs/architecture.md §3.12, infra/gateway_auth.py): only an authenticated caller reaches
a model, checked at the Gateway and again at the pod.

- `gateway-api-keys-required`: every model route (HTTPRoute, GRPCRoute) is covered by an Envoy Gateway
  SecurityPolicy with API keys (`apiKeyAuth`) or JWT, targeting the route or the Gateway it attaches to; the keys'
  Secret comes from an ExternalSecret (a secret store), never a Secret whose value the program holds.
- `serving-api-keys-required`: every model server mounts its keys' Secret read-only (a required secret volume) and
  names it in pod_contract.ENV_API_KEYS_FILE.
- `serving-kserve-ports-authenticated`: every model server sets pod_contract.ENV_REQUIRE_API_KEYS=1, which makes the
  server refuse to start without a key and check it on the KServe ports (8000, 8001), not the OpenAI port alone.
- `batch-worker-key-required`: a batch worker (it calls through the Gateway) mounts its key's Secret, required.
"""

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

from llm_serving import pod_contract as pc

from .._props import get, iter_mappings, k8s_name, k8s_namespace, labels
from ..index import StackIndex, is_serving_workload
from ..workload import DEPLOYMENT, pod_spec, pod_template, serving_containers

ROUTE_KINDS = ("HTTPRoute", "GRPCRoute")
BATCH_WORKER_COMPONENT = "batch-worker"
BATCH_WORKER_KEY_ENV = pc.ENV_BATCH_WORKER_API_KEY_FILE


def _env(container: Mapping[str, Any], name: str) -> str | None:
    for env in iter_mappings(container.get("env")):
        if env.get("name") == name:
            return None if env.get("value") is None else str(env.get("value"))
    return None


def _authenticates(spec: Mapping[str, Any]) -> str | None:
    """What a SecurityPolicy's spec authenticates callers with ("apiKeyAuth", "jwt"), or None."""
    api_keys = spec.get("apiKeyAuth")
    if isinstance(api_keys, Mapping) and list(iter_mappings(api_keys.get("credentialRefs"))) and list(
            iter_mappings(api_keys.get("extractFrom"))):
        return "apiKeyAuth"
    jwt = spec.get("jwt")
    if isinstance(jwt, Mapping) and list(iter_mappings(jwt.get("providers"))):
        return "jwt"
    return None


def _targets(policy_props: Mapping[str, Any]) -> set[tuple[str, str]]:
    refs = list(iter_mappings(get(policy_props, "spec", "targetRefs")))
    single = get(policy_props, "spec", "targetRef")
    if isinstance(single, Mapping):
        refs.append(single)
    return {(str(r.get("kind") or ""), str(r.get("name") or "")) for r in refs}


def _validate_gateway_auth(args: StackValidationArgs, report: ReportViolation) -> None:
    index = StackIndex(args.resources)
    policies = [p for p in index.k8s("SecurityPolicy") if _authenticates(get(p.props, "spec") or {})]
    external_targets = {(k8s_namespace(e.props), str(get(e.props, "spec", "target", "name") or k8s_name(e.props)))
                        for e in index.k8s("ExternalSecret")}
    plain_secrets = {(k8s_namespace(s.props), k8s_name(s.props)) for s in index.k8s("Secret")}
    for policy in policies:
        namespace = k8s_namespace(policy.props)
        refs = list(iter_mappings(get(policy.props, "spec", "apiKeyAuth", "credentialRefs")))
        for ref in refs:
            secret = (str(ref.get("namespace") or namespace), str(ref.get("name") or ""))
            if secret in plain_secrets:
                why = "the program writes itself (its value would be in the stack's state)"
            elif secret not in external_targets:
                why = "no ExternalSecret of this stack produces"
            else:
                continue
            report(f"SecurityPolicy {k8s_name(policy.props)!r} reads API keys from Secret {secret[1]!r}, which "
                   f"{why}: the keys come from the secret store through an ExternalSecret (infra/gateway_auth.py)",
                   policy.urn)
    for route in [r for kind in ROUTE_KINDS for r in index.k8s(kind)]:
        namespace = k8s_namespace(route.props)
        kind = route.resource_type.rsplit(":", 1)[-1]
        name = k8s_name(route.props) or route.name
        gateways = {str(p.get("name") or "") for p in iter_mappings(get(route.props, "spec", "parentRefs"))
                    if str(p.get("kind") or "Gateway") == "Gateway" and str(p.get("namespace") or namespace)
                    == namespace}
        covered = any(k8s_namespace(p.props) == namespace and any(
            (k == kind and n == name) or (k == "Gateway" and n in gateways) for k, n in _targets(p.props))
            for p in policies)
        if not covered:
            report(f"{kind} {name!r}: no SecurityPolicy with API keys (apiKeyAuth) or JWT targets it or its Gateway "
                   f"({', '.join(sorted(gateways)) or 'none'}): anyone who reaches the load balancer calls the "
                   f"model", route.urn)


def _secret_volumes(props: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(v.get("name")): v["secret"] for v in iter_mappings(pod_spec(props).get("volumes"))
            if isinstance(v.get("secret"), Mapping)}


def _key_mount_problem(props: Mapping[str, Any], container: Mapping[str, Any], path: str | None) -> str | None:
    """Why `path` (a key file or directory) is not a required Secret's read-only mount in `container`."""
    if not path:
        return "names no key file"
    secrets = _secret_volumes(props)
    for mount in iter_mappings(container.get("volumeMounts")):
        mount_path = str(mount.get("mountPath") or "").rstrip("/")
        if not mount_path or not (path == mount_path or path.startswith(mount_path + "/")):
            continue
        secret = secrets.get(str(mount.get("name")))
        if secret is None:
            return f"reads its keys from {path}, which is not a Secret's volume"
        if secret.get("optional") is True:
            return (f"mounts Secret {secret.get('secretName')!r} optional: a pod without it would start without "
                    f"its key")
        if mount.get("readOnly") is not True:
            return f"mounts its keys' Secret at {mount_path} writable"
        return None
    return f"reads its keys from {path}, which no volume is mounted at"


def _validate_serving_keys(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != DEPLOYMENT or not is_serving_workload(args.props):
        return
    for container in serving_containers(args.props):
        problem = _key_mount_problem(args.props, container, _env(container, pc.ENV_API_KEYS_FILE))
        if problem:
            report(f"Deployment {args.name!r} container {container.get('name')!r} {problem} "
                   f"({pc.ENV_API_KEYS_FILE}): a model pod checks the caller's key itself, from a required Secret "
                   f"mounted read-only ({pc.API_KEYS_SECRET} at {pc.API_KEYS_MOUNT})", None)


def _validate_kserve_keys(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != DEPLOYMENT or not is_serving_workload(args.props):
        return
    for container in serving_containers(args.props):
        value = _env(container, pc.ENV_REQUIRE_API_KEYS)
        if value != "1":
            report(f"Deployment {args.name!r} container {container.get('name')!r}: {pc.ENV_REQUIRE_API_KEYS} is "
                   f"{value!r}, not '1': its KServe ports ({pc.PORTS[pc.KSERVE_HTTP_PORT_NAME]}, "
                   f"{pc.PORTS[pc.KSERVE_GRPC_PORT_NAME]}) would answer without a key and a missing key would not "
                   f"stop the pod", None)


def _validate_batch_worker_key(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != DEPLOYMENT:
        return
    if {**labels(args.props), **labels(pod_template(args.props))}.get(
            "app.kubernetes.io/component") != BATCH_WORKER_COMPONENT:
        return
    for container in iter_mappings(pod_spec(args.props).get("containers")):
        problem = _key_mount_problem(args.props, container, _env(container, BATCH_WORKER_KEY_ENV))
        if problem:
            report(f"batch worker Deployment {args.name!r} container {container.get('name')!r} {problem} "
                   f"({BATCH_WORKER_KEY_ENV}): it calls its model through the Gateway, which refuses a caller "
                   f"without a key", None)


gateway_api_keys_required = StackValidationPolicy(
    name="gateway-api-keys-required",
    description="Every model route is covered by an Envoy Gateway SecurityPolicy with API keys or JWT (on the route "
                "or its Gateway), whose keys' Secret an ExternalSecret produces from the secret store.",
    validate=_validate_gateway_auth,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_api_keys_required = ResourceValidationPolicy(
    name="serving-api-keys-required",
    description=f"Every model server reads its API keys ({pc.ENV_API_KEYS_FILE}) from a required Secret volume "
                "mounted read-only.",
    validate=_validate_serving_keys,
    enforcement_level=EnforcementLevel.MANDATORY,
)
serving_kserve_ports_authenticated = ResourceValidationPolicy(
    name="serving-kserve-ports-authenticated",
    description=f"Every model server sets {pc.ENV_REQUIRE_API_KEYS}=1: no start without a key, and the key checked on "
                "the KServe HTTP and gRPC ports as on the OpenAI port.",
    validate=_validate_kserve_keys,
    enforcement_level=EnforcementLevel.MANDATORY,
)
batch_worker_key_required = ResourceValidationPolicy(
    name="batch-worker-key-required",
    description="Every batch worker reads its API key from a required Secret volume mounted read-only.",
    validate=_validate_batch_worker_key,
    enforcement_level=EnforcementLevel.MANDATORY,
)

POLICIES = [gateway_api_keys_required, serving_api_keys_required, serving_kserve_ports_authenticated,
            batch_worker_key_required]
