"""Reading a serving Deployment: its pod spec, containers, GPUs, probes, security context."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._props import as_bool, as_number, get, iter_mappings, labels

DEPLOYMENT = "kubernetes:apps/v1:Deployment"
GPU_RESOURCE = "nvidia.com/gpu"
NAME_LABEL = "app.kubernetes.io/name"
VERSION_LABEL = "app.kubernetes.io/version"
# Kubernetes' defaults for a probe's timing fields.
PROBE_DEFAULTS = {"initialDelaySeconds": 0, "periodSeconds": 10, "failureThreshold": 3}


def pod_template(props: Mapping[str, Any]) -> Mapping[str, Any]:
    return get(props, "spec", "template") or {}


def pod_spec(props: Mapping[str, Any]) -> Mapping[str, Any]:
    return get(props, "spec", "template", "spec") or {}


def containers(props: Mapping[str, Any], init: bool = False) -> list[Mapping[str, Any]]:
    spec = pod_spec(props)
    found = list(iter_mappings(spec.get("containers")))
    if init:
        found += list(iter_mappings(spec.get("initContainers")))
    return found


def gpu_limit(container: Mapping[str, Any]) -> float | None:
    return as_number(get(container, "resources", "limits", GPU_RESOURCE))


def serving_containers(props: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The containers that hold GPUs: the model servers. Without any, the first container is the server."""
    found = [c for c in containers(props) if gpu_limit(c)]
    if found:
        return found
    first = containers(props)[:1]
    return first


def model_identity(props: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(model id, version) from the §3.10 labels of the Deployment, or of its pod template."""
    merged = {**labels(pod_template(props)), **labels(props)}
    return merged.get(NAME_LABEL), merged.get(VERSION_LABEL)


def replicas(props: Mapping[str, Any]) -> float:
    value = as_number(get(props, "spec", "replicas"))
    return 1.0 if value is None else value  # Kubernetes' default


def probe_budget_seconds(probe: Mapping[str, Any]) -> float:
    """How long a probe lets a container take before it gives up on it: initialDelay + failureThreshold x period."""
    timing = {k: as_number(probe.get(k)) for k in PROBE_DEFAULTS}
    timing = {k: (v if v is not None else PROBE_DEFAULTS[k]) for k, v in timing.items()}
    return timing["initialDelaySeconds"] + timing["failureThreshold"] * timing["periodSeconds"]


def effective_security(props: Mapping[str, Any], container: Mapping[str, Any], key: str) -> Any:
    """A securityContext field as Kubernetes applies it: the container's value, else the pod's."""
    own = get(container, "securityContext", key)
    return own if own is not None else get(pod_spec(props), "securityContext", key)


def is_true(value: Any) -> bool:
    return as_bool(value) is True
