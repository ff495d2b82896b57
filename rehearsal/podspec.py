"""From a rendered Deployment to the container the rehearsal starts for each of its pods (pure: nothing runs here).

The container runs the built image's ENTRYPOINT (read from the image's configuration) with the container's
command/args, its environment is the image's ENV, then the substitutions' replacements of image-only values, then
exactly the container's rendered env on top; its volumeMounts are mounted at their mountPaths; it runs as the pod's
user (container.py turns a plan into `podman run`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from llm_serving import dockerfile
from rehearsal import substitutions as subs


class PodSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Mount:
    target: str
    kind: str  # "bind" | "tmpfs"
    source: str | None = None  # host path of a bind
    read_only: bool = False
    size: str | None = None  # tmpfs size
    volume: str | None = None


@dataclass(frozen=True)
class Probe:
    kind: str  # startup | readiness | liveness
    path: str
    port: int
    period_s: float
    failure_threshold: int
    timeout_s: float
    initial_delay_s: float = 0.0
    success_threshold: int = 1


@dataclass
class PodPlan:
    name: str
    deployment: str
    namespace: str
    labels: dict[str, str]
    argv: list[str]
    env: dict[str, str]
    rendered_env: dict[str, str]
    mounts: list[Mount]
    uid: int
    gid: int
    groups: list[int]
    read_only_root: bool
    no_new_privs: bool
    workdir: str
    ports: dict[str, int]
    probes: dict[str, Probe]
    grace_period_s: float
    prestop_sleep_s: float
    resources: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)


def _quantity_bytes(text: str | None) -> str | None:
    """A Kubernetes quantity as a tmpfs size (`16Gi` -> `16g`)."""
    if not text:
        return None
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(text))
    if not m:
        raise PodSpecError(f"sizeLimit {text!r}: not a quantity the rehearsal understands (e.g. 16Gi)")
    return m.group(1) + {"Ki": "k", "Mi": "m", "Gi": "g", "Ti": "g"}.get(m.group(2) or "", "")


def _port(value: Any, ports: dict[str, int], where: str) -> int:
    if isinstance(value, (int, float)):
        return int(value)
    if value in ports:
        return ports[value]
    raise PodSpecError(f"{where}: port {value!r} is neither a number nor one of the container's ports {sorted(ports)}")


def _probe(kind: str, spec: dict[str, Any] | None, ports: dict[str, int], where: str) -> Probe | None:
    if not spec:
        return None
    http = spec.get("httpGet")
    if not http:
        raise PodSpecError(f"{where}.{kind}Probe: only httpGet probes are rehearsed, got {sorted(spec)}")
    return Probe(kind, http.get("path", "/"), _port(http.get("port"), ports, f"{where}.{kind}Probe"),
                 float(spec.get("periodSeconds", 10)), int(spec.get("failureThreshold", 3)),
                 float(spec.get("timeoutSeconds", 1)), float(spec.get("initialDelaySeconds", 0)),
                 int(spec.get("successThreshold", 1)))


def pod_plans(deployment: dict[str, Any], image: dockerfile.ImageFacts, volume_sources: dict[str, str],
              scratch_for: Any, cloud_env: dict[str, str] | None = None,
              secret_sources: dict[str, str] | None = None) -> list[PodPlan]:
    """One plan per replica. `volume_sources`: claim name -> host directory (the model cache); `scratch_for(pod,
    volume)` gives a host directory for an emptyDir (and for an optional Secret's empty volume); `cloud_env` what
    stands in for the cloud's credentials and endpoints (substitutions.cloud_env), under the rendered env;
    `secret_sources`: Secret name -> host directory of the Secrets the rehearsal made (secrets.py), mounted
    read-only."""
    secret_sources = secret_sources or {}
    inputs = deployment["inputs"]
    name = inputs["metadata"]["name"]
    namespace = inputs["metadata"].get("namespace", "default")
    spec = inputs["spec"]
    template = spec["template"]
    pod = template["spec"]
    containers = pod.get("containers") or []
    if len(containers) != 1:
        raise PodSpecError(f"Deployment {name}: the rehearsal runs one container per pod, found {len(containers)}")
    (container,) = containers
    where = f"Deployment {name} container {container.get('name')}"
    ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports") or [] if p.get("name")}
    if container.get("command"):
        argv = list(container["command"]) + list(container.get("args") or [])
    else:
        if not image.entrypoint:
            raise PodSpecError(f"{where}: no command and the image has no ENTRYPOINT")
        argv = list(image.entrypoint) + list(container.get("args") or list(image.cmd))
    rendered = {}
    for item in container.get("env") or []:
        if "value" not in item:
            raise PodSpecError(f"{where}: env {item.get('name')!r} comes from {sorted(set(item) - {'name'})}; "
                               "the rehearsal takes literal values only")
        rendered[item["name"]] = str(item["value"])
    env = {**image.env, **subs.IMAGE_ENV_OVERRIDES, **(cloud_env or {}), **rendered}

    security = {**(pod.get("securityContext") or {}), **(container.get("securityContext") or {})}
    uid = security.get("runAsUser")
    if uid is None:
        uid = int(image.user) if image.user and image.user.isdigit() else None
    if uid is None:
        raise PodSpecError(f"{where}: no runAsUser and the image's USER is not numeric")
    if security.get("runAsNonRoot") and int(uid) == 0:
        raise PodSpecError(f"{where}: runAsNonRoot with uid 0 would not start")
    gid = int(security.get("runAsGroup", uid))
    groups = [int(security["fsGroup"])] if "fsGroup" in (pod.get("securityContext") or {}) else []
    replicas = int(spec.get("replicas", 1))
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    prestop = ((container.get("lifecycle") or {}).get("preStop") or {})
    prestop_s = float((prestop.get("sleep") or {}).get("seconds", 0))
    probes = {k: p for k in ("startup", "readiness", "liveness")
              if (p := _probe(k, container.get(f"{k}Probe"), ports, where))}
    plans = []
    for i in range(replicas):
        pod_name = f"{name}-{i}"
        mounts = []
        for vm in container.get("volumeMounts") or []:
            volume = volumes.get(vm["name"])
            if volume is None:
                raise PodSpecError(f"{where}: volumeMount {vm['name']!r} names no volume of the pod")
            read_only = bool(vm.get("readOnly"))
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                if claim not in volume_sources:
                    raise PodSpecError(f"{where}: claim {claim!r} is not one the rehearsal provides "
                                       f"({sorted(volume_sources)})")
                mounts.append(Mount(vm["mountPath"], "bind", volume_sources[claim],
                                    read_only or volume["persistentVolumeClaim"].get("readOnly", False), None,
                                    vm["name"]))
            elif "emptyDir" in volume:
                empty = volume["emptyDir"] or {}
                if empty.get("medium") == "Memory":
                    mounts.append(Mount(vm["mountPath"], "tmpfs", None, read_only,
                                        _quantity_bytes(empty.get("sizeLimit")), vm["name"]))
                else:
                    mounts.append(Mount(vm["mountPath"], "bind", str(scratch_for(pod_name, vm["name"])), read_only,
                                        None, vm["name"]))
            elif "secret" in volume:
                # The Secrets the rehearsal made (secrets.py: every ExternalSecret's target), read-only. Kubernetes
                # mounts an optional Secret that does not exist as an empty volume; a required one that does not
                # exist keeps the pod from starting: named here.
                secret = volume["secret"] or {}
                source = secret_sources.get(str(secret.get("secretName")))
                if source is not None:
                    mounts.append(Mount(vm["mountPath"], "bind", source, True, None, vm["name"]))
                    continue
                if not secret.get("optional"):
                    raise PodSpecError(f"{where}: volume {vm['name']!r} is the Secret {secret.get('secretName')!r}, "
                                       "which is not optional and which no ExternalSecret of the stack produces "
                                       f"(the rehearsal's Secrets: {sorted(secret_sources) or 'none'})")
                mounts.append(Mount(vm["mountPath"], "bind", str(scratch_for(pod_name, vm["name"])), True, None,
                                    vm["name"]))
            else:
                raise PodSpecError(f"{where}: volume {vm['name']!r} is of a kind the rehearsal does not provide "
                                   f"({sorted(volume)})")
        plans.append(PodPlan(
            name=pod_name, deployment=name, namespace=namespace, labels=dict(template["metadata"]["labels"]),
            argv=argv, env=env, rendered_env=rendered, mounts=mounts, uid=int(uid), gid=gid, groups=groups,
            read_only_root=bool(security.get("readOnlyRootFilesystem")),
            no_new_privs=security.get("allowPrivilegeEscalation") is False,
            workdir=container.get("workingDir") or image.workdir or "/", ports=ports, probes=probes,
            grace_period_s=float(pod.get("terminationGracePeriodSeconds", 30)), prestop_sleep_s=prestop_s,
            resources=container.get("resources") or {}, node_selector=pod.get("nodeSelector") or {},
            tolerations=pod.get("tolerations") or []))
    return plans


def startup_budget_s(probe: Probe | None) -> float:
    if probe is None:
        return 0.0
    return probe.initial_delay_s + probe.period_s * probe.failure_threshold


def placement_report(plan: PodPlan, node_groups: list[dict[str, Any]]) -> str:
    """Where the pod would land: the node groups whose labels satisfy its nodeSelector and whose taints it
    tolerates, with what it requests. GPUs are not granted here."""
    fits = []
    for group in node_groups:
        labels = group.get("labels") or {}
        if not all(labels.get(k) == v for k, v in plan.node_selector.items()):
            continue
        taints = group.get("taints") or []
        tolerated = all(any(t.get("key") == taint.get("key") and (t.get("operator") == "Exists" or
                                                                  t.get("value") == taint.get("value"))
                            for t in plan.tolerations) for taint in taints)
        if tolerated:
            fits.append(f"{group['name']} ({', '.join(group.get('instanceTypes') or [])})")
    requests = plan.resources.get("requests") or {}
    limits = plan.resources.get("limits") or {}
    gpus = limits.get("nvidia.com/gpu") or requests.get("nvidia.com/gpu")
    where = ", ".join(fits) if fits else "no node group (nodeSelector/tolerations match none)"
    shown = ", ".join(f"{k}={v}" for k, v in sorted(requests.items()))
    capped = ", ".join(f"{k}={v}" for k, v in sorted(limits.items()))
    return (f"{plan.name}: requests {shown or 'nothing'}, limits {capped or 'none'}; would land on {where}"
            + (f"; {gpus} GPU(s) requested, none can be granted on this machine" if gpus else ""))
