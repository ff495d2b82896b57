"""This machine as the pods' node (docs/rehearsal.md, "What it does", the pods row): what a kubelet's node gives a pod
before its container starts, and the pods it holds.

    a rendered Deployment  --Node.plans_for-->  PodPlans (podspec.py: the image's config, the claims, fresh emptyDirs)
    a PodPlan              --Node.add_pod-->    a PodRunner (kubelet.py) in a network namespace of its own (net.py),
                                                its container a `podman run` of the built image (container.py)

The rehearsal's first pods and the rollout's later ones (cluster.py) come through the same two doors, so a pod that
a scenario starts is made exactly as the first ones were.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from image_build import containers
from llm_serving import dockerfile
from rehearsal import net, podspec, render, secrets, substitutions
from rehearsal.container import ContainerProcess, run_argv
from rehearsal.kubelet import PodRunner
from rehearsal.net import Network


class Node:
    """The pods' node under `workdir`; `install` must run before the first plan (it needs the store's endpoint)."""

    def __init__(self, workdir: Path, image: str, net: Network):
        self.workdir = workdir
        self.image = image  # the image `make image` built: every pod's container runs it
        self.net = net
        self.runners: list[PodRunner] = []  # cluster.py adds and removes pods in place
        self.tasks: list[asyncio.Task] = []
        self.pod_count = 0  # pods created so far: the next pod's network index
        self._containers = itertools.count()  # each container's name is new (a restart is a new container)
        self._plans_for: Callable[[dict[str, Any]], list[podspec.PodPlan]] | None = None
        # The Secrets the pods mount, made for this run (secrets.py): set by `install`.
        self.secrets: secrets.SecretsPlan | None = None
        self.network_policies: list[dict[str, Any]] = []  # the rendered NetworkPolicies' inputs (net.py enforces)
        self.policy_namespaces: tuple[str, ...] = ()  # whose peers run in the node namespace here

    # -- plans -------------------------------------------------------------------------------------------------

    def install(self, rendered: render.Rendered, fsx: Path, store_endpoint: str) -> None:
        """The image's configuration the pods run with, and the claims they mount (the model cache is the FSx
        directory)."""
        image = dockerfile.from_image_config(containers.inspect(self.image)["Config"])
        claims = {}
        for claim in rendered.of_type("kubernetes:core/v1:PersistentVolumeClaim"):
            claims[claim["inputs"]["metadata"]["name"]] = str(fsx)

        def scratch(pod: str, volume: str) -> Path:
            # A fresh directory per plan: an emptyDir lives as long as its pod, and a plan may be made for a name
            # that runs (scaling a Deployment up plans every replica; the cluster drops the running ones' plans) or
            # that ran before (a version rolled out again).
            path, n = self.workdir / "pods" / pod / volume, 1
            while path.exists():
                n += 1
                path = self.workdir / "pods" / pod / f"{volume}.{n}"
            path.mkdir(parents=True)
            path.chmod(0o777)  # an emptyDir: writable by the pod's user (and its fsGroup)
            return path

        cloud = substitutions.cloud_env(store_endpoint)
        self.network_policies = [p["inputs"] for p in rendered.of_type("kubernetes:networking.k8s.io/v1:NetworkPolicy")]
        serving = rendered.config.get("llm-serving:serving") or {}
        self.policy_namespaces = (net.GATEWAY_PROXY_NAMESPACE, serving.get("monitoringNamespace") or "monitoring")
        # What External Secrets would sync from Secrets Manager: every ExternalSecret's target Secret, with key
        # material made for this run, mounted read-only where a pod's secret volume names it.
        self.secrets = secrets.plan_secrets(e["inputs"] for e in rendered.of_type(secrets.EXTERNAL_SECRET))
        secret_dirs = self.secrets.write(self.workdir / "secrets")
        secrets.use_for_requests(self.secrets)  # every request of the run presents the rehearsal client's key

        def plans_for(deployment: dict[str, Any]) -> list[podspec.PodPlan]:
            return podspec.pod_plans(deployment, image, claims, scratch, cloud, secret_dirs)

        self._plans_for = plans_for

    def plans_for(self, deployment: dict[str, Any]) -> list[podspec.PodPlan]:
        """A rendered Deployment's pods' plans (the rollout scenarios' new Deployments get theirs the same way)."""
        if self._plans_for is None:
            raise RuntimeError("Node.install has not run: no image files and claims to plan pods with")
        return self._plans_for(deployment)

    # -- pods --------------------------------------------------------------------------------------------------

    def add_pod(self, plan: podspec.PodPlan, on_change=lambda: None) -> PodRunner:
        """A pod for `plan` in a network namespace of its own (not started yet)."""
        namespace, address = self.net.create_pod(self.pod_count)
        self.pod_count += 1
        # The rendered NetworkPolicies that select the pod, enforced on the node before its container starts.
        rules = net.policy_rules(self.network_policies, plan.namespace, plan.labels, self.policy_namespaces)
        if rules is not None:
            self.net.restrict_pod(address, rules)
        runner = PodRunner(plan, address, self._launch(namespace), self.workdir / "logs", on_change=on_change)
        self.runners.append(runner)
        return runner

    def start_pod(self, runner: PodRunner) -> None:
        self.tasks.append(asyncio.create_task(runner.run(), name=runner.plan.name))

    def _launch(self, namespace: str):
        def launch(plan: podspec.PodPlan, log_path: Path) -> ContainerProcess:
            name = f"rehearsal-{plan.name}-{next(self._containers)}"
            return ContainerProcess(run_argv(plan, self.image, name, namespace), name, log_path)

        return launch

    # -- the end -----------------------------------------------------------------------------------------------

    def kill_pods(self) -> None:
        """Every pod's processes killed at once (the last resort: stop_pods in run.py terminates them first)."""
        for runner in self.runners:
            runner.kill_now()
