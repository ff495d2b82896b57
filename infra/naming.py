"""Names and the recommended Kubernetes labels (docs/architecture.md §3.10) shared by every per-model object."""

from __future__ import annotations

import re

MANAGED_BY = "pulumi"
PART_OF = "llm-serving"
COMPONENT = "model-server"
GPU_NODE_GROUP_LABEL = "llm-serving/gpu-node-group"
CPU_NODE_GROUP_LABEL = "llm-serving/cpu-node-group"  # the node groups for models without GPUs
POOL_LABEL = "llm-serving/pool"


def version_slug(version: str) -> str:
    """A model version as a DNS-label fragment: `1.4.0` -> `1-4-0`, `2024_06` -> `2024-06`."""
    return re.sub(r"[^a-z0-9-]", "-", version.lower()).strip("-")


def instance_name(model_id: str, version: str) -> str:
    return f"{model_id}-{version_slug(version)}"


def model_labels(model_id: str, version: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": model_id,
        "app.kubernetes.io/version": version,
        "app.kubernetes.io/component": COMPONENT,
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/instance": instance_name(model_id, version),
    }


def selector_labels(model_id: str, version: str) -> dict[str, str]:
    """The immutable subset a Deployment/Service selects on: one (model, version) pair."""
    return {"app.kubernetes.io/name": model_id, "app.kubernetes.io/instance": instance_name(model_id, version)}


def platform_labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/managed-by": MANAGED_BY,
            "app.kubernetes.io/component": component}


def aws_tags(stack: str, environment: str, team: str, **extra: str) -> dict[str, str]:
    """Every AWS resource's tags: `team` and `env` are the cost allocation tags GPU-hours are charged by."""
    return {"team": team, "env": environment, "llm-serving:stack": stack, "managed-by": MANAGED_BY, **extra}


def cost_labels(team: str, environment: str, model_id: str) -> dict[str, str]:
    """Pod labels that EKS split cost allocation turns into cost allocation tags."""
    return {"team": team, "env": environment, "model": model_id}
