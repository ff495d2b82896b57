"""This machine as the pods' node (docs/rehearsal.md, "What it does", the pods row): what a kubelet's node gives a pod
before its container starts, and the pods it holds.

    a rendered Deployment  --Node.plans_for-->  PodPlans (podspec.py: the image's files, the claims, fresh emptyDirs)
    a PodPlan              --Node.add_pod-->    a PodRunner (kubelet.py) in a network namespace of its own (net.py),
                                                its mount points made here, its launch into namespaces (launcher.py)

The rehearsal's first pods and the rollout's later ones (cluster.py) come through the same two doors, so a pod that
a scenario starts is made exactly as the first ones were.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llm_serving import dockerfile
from llm_serving_cli.rehearsal import podspec, render, substitutions
from llm_serving_cli.rehearsal.kubelet import PodRunner
from llm_serving_cli.rehearsal.net import Network
from llm_serving_cli.rehearsal.substitutions import REPO_ROOT

DOCKERFILE = REPO_ROOT / "serving_image" / "Dockerfile"


class Node:
    """The pods' node under `workdir`; `install` must run before the first plan (it needs the store's endpoint)."""

    def __init__(self, workdir: Path, python: Path, net: Network):
        self.workdir = workdir
        self.python = python
        self.net = net
        self.runners: list[PodRunner] = []  # cluster.py adds and removes pods in place
        self.tasks: list[asyncio.Task] = []
        self.pod_count = 0  # pods created so far: the next pod's network index
        self.created_mountpoints: list[Path] = []
        self._plans_for: Callable[[dict[str, Any]], list[podspec.PodPlan]] | None = None

    # -- plans -------------------------------------------------------------------------------------------------

    def install(self, rendered: render.Rendered, fsx: Path, store_endpoint: str) -> None:
        """The image's files the pods run from, and the claims they mount (the model cache is the FSx directory)."""
        image = dockerfile.read(DOCKERFILE)
        bin_dir = self.workdir / "image-bin"
        bin_dir.mkdir()
        # A wrapper, not a symlink: a venv's interpreter finds its environment from the path it is run by.
        (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {self.python} "$@"\n')
        (bin_dir / "python3").chmod(0o755)
        bin_dir.chmod(0o755)
        stand_in = self.workdir / "nvidia_entrypoint.sh"
        stand_in.write_text(substitutions.NVIDIA_ENTRYPOINT_STAND_IN)
        stand_in.chmod(0o755)
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

        def plans_for(deployment: dict[str, Any]) -> list[podspec.PodPlan]:
            return podspec.pod_plans(deployment, image, claims, scratch, bin_dir, stand_in, cloud)

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
        self._mountpoints([plan])
        runner = PodRunner(plan, address, self._launch({plan.name: namespace}), self.workdir / "logs",
                           on_change=on_change)
        self.runners.append(runner)
        return runner

    def start_pod(self, runner: PodRunner) -> None:
        self.tasks.append(asyncio.create_task(runner.run(), name=runner.plan.name))

    def _mountpoints(self, plans: list[podspec.PodPlan]) -> None:
        """Mount points the pods need that this machine lacks (created once, removed at the end)."""
        for plan in plans:
            for mount in plan.mounts:
                target = Path(mount.target)
                if target.exists() or target.is_symlink():
                    continue
                missing = next((p for p in [*reversed(target.parents), target] if not p.exists()), target)
                if mount.source and Path(mount.source).is_file():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.touch()
                else:
                    target.mkdir(parents=True, exist_ok=True)
                self.created_mountpoints.append(missing)

    def _launch(self, namespace_of: dict[str, str]):
        readable = sorted({str(substitutions.interpreter_home(self.python)), str(REPO_ROOT)})

        def launch(plan: podspec.PodPlan, log_path: Path) -> subprocess.Popen:
            spec = {"mounts": [asdict(m) for m in plan.mounts], "env": plan.env, "argv": plan.argv,
                    "uid": plan.uid, "gid": plan.gid, "groups": plan.groups, "read_only_root": plan.read_only_root,
                    "no_new_privs": plan.no_new_privs, "workdir": plan.workdir, "readable": readable,
                    "staging": str(self.workdir / "staging" / plan.name)}
            path = self.workdir / "plans" / f"{plan.name}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(spec, indent=1))
            log = open(log_path, "w")  # noqa: SIM115 (the child holds it)
            try:
                return subprocess.Popen(
                    ["ip", "netns", "exec", namespace_of[plan.name], "unshare", "--mount", "--propagation",
                     "private", "--", str(self.python), "-m", "llm_serving_cli.rehearsal.launcher", str(path)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                    cwd=REPO_ROOT)
            finally:
                log.close()

        return launch

    # -- the end -----------------------------------------------------------------------------------------------

    def kill_pods(self) -> None:
        """Every pod's processes killed at once (the last resort: stop_pods in run.py terminates them first)."""
        for runner in self.runners:
            runner.kill_now()

    def remove_mountpoints(self) -> None:
        for path in reversed(self.created_mountpoints):
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
