"""Every policy of the pack, in report order. Importing this starts nothing (the PolicyPack is built only in
`policies/__main__.py`)."""

from __future__ import annotations

from pulumi_policy import EnforcementLevel, Policy

from .rules import (
    auth,
    batch,
    bootstrap,
    capacity,
    cost,
    experiments,
    fsx,
    gpu_nodes,
    iam,
    nodes,
    platform,
    python_deps,
    rollout,
    s3,
    serving,
)

ALL_POLICIES: list[Policy] = [
    *s3.POLICIES,
    *fsx.POLICIES,
    *gpu_nodes.POLICIES,
    *capacity.POLICIES,
    *nodes.POLICIES,
    *bootstrap.POLICIES,
    *iam.POLICIES,
    *serving.POLICIES,
    *auth.POLICIES,
    *python_deps.POLICIES,
    *rollout.POLICIES,
    *experiments.POLICIES,
    *batch.POLICIES,
    *platform.POLICIES,
    *cost.POLICIES,
]


def by_name(name: str) -> Policy:
    for policy in ALL_POLICIES:
        if policy.name == name:
            return policy
    raise KeyError(f"no policy named {name!r}; known: {', '.join(p.name for p in ALL_POLICIES)}")


def enforcement(policy: Policy) -> EnforcementLevel:
    # The pack's default level is advisory (PolicyPack's own default); every rule here sets its level explicitly.
    return policy.enforcement_level or EnforcementLevel.ADVISORY
