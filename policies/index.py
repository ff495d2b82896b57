"""Joins across a stack's resources, for the StackValidationPolicies.

Side resources refer to their subject by a value that only exists after creation (an S3 bucket's id, a
Service's name): the reliable link is the dependency Pulumi records when one resource's input is another's
output, so joins go through `dependencies` first and fall back to matching names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pulumi_policy import PolicyResource

from ._props import get, k8s_name, k8s_namespace, labels

SERVING_COMPONENT = "model-server"


def ancestors(resource: PolicyResource) -> list[PolicyResource]:
    chain = []
    cur = resource.parent
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.parent
    return chain


class StackIndex:
    def __init__(self, resources: Iterable[PolicyResource]) -> None:
        self.resources = list(resources)
        self.by_urn = {r.urn: r for r in self.resources}

    def of_type(self, *types: str) -> list[PolicyResource]:
        return [r for r in self.resources if r.resource_type in types]

    def k8s(self, kind: str) -> list[PolicyResource]:
        """Kubernetes objects of one kind, whatever their API version (typed or CustomResource)."""
        return [
            r
            for r in self.resources
            if r.resource_type.startswith("kubernetes:") and r.resource_type.rsplit(":", 1)[-1] == kind
        ]

    def k8s_named(self, kind: str, namespace: str, name: str) -> PolicyResource | None:
        for r in self.k8s(kind):
            if k8s_name(r.props) == name and k8s_namespace(r.props) == namespace:
                return r
        return None

    @staticmethod
    def depends_on(resource: PolicyResource, other: PolicyResource) -> bool:
        """True when Pulumi orders `resource` after `other`: a direct dependency, a property dependency, or a
        dependency on a component that contains `other`."""
        deps = list(resource.dependencies)
        for values in resource.property_dependencies.values():
            deps.extend(values)
        if other in deps:
            return True
        containers = set(map(id, ancestors(other)))
        return any(id(d) in containers for d in deps)

    def referenced(self, resource: PolicyResource, types: tuple[str, ...], key: str, name_keys: tuple[str, ...]):
        """The one resource of `types` that `resource.props[key]` refers to, or None (see `references`)."""
        found = self.references(resource, types, key, name_keys)
        return found[0] if len(found) == 1 else None

    def references(
        self, resource: PolicyResource, types: tuple[str, ...], key: str, name_keys: tuple[str, ...]
    ) -> list[PolicyResource]:
        """The resources of `types` that `resource.props[key]` may refer to.

        The property's own dependencies decide when the engine (or the runner) recorded them. Otherwise the
        resource's dependencies of those types; when there are several (a security group rule depends on its group
        and on its source group), an equal name narrows them, and if nothing does all of them are returned, so a
        rule errs on the strict side rather than skipping a check.
        """
        by_property = [r for r in resource.property_dependencies.get(key, []) if r.resource_type in types]
        if by_property:
            return by_property
        candidates = self.of_type(*types)
        linked = [c for c in candidates if self.depends_on(resource, c)]
        value = get(resource.props, key)
        named = [
            c for c in (linked or candidates) if value is not None and value in [get(c.props, k) for k in name_keys]
        ]
        if len(linked) == 1:
            return linked
        if named:
            return named[:1] if len(named) == 1 else named
        return linked

def is_serving_workload(props: Mapping[str, Any]) -> bool:
    """A per-model server: the §3.10 component label on the object or on its pod template."""
    template = get(props, "spec", "template") or {}
    return (
        labels(props).get("app.kubernetes.io/component") == SERVING_COMPONENT
        or labels(template).get("app.kubernetes.io/component") == SERVING_COMPONENT
    )


def selector_matches(selector: Mapping[str, Any] | None, pod_labels: Mapping[str, str]) -> bool:
    if not selector:
        return False
    return all(pod_labels.get(k) == v for k, v in selector.items())
