"""A rehearsed pod's container: the image `make image` built, run by podman as the pod's plan says (docs/rehearsal.md).

The container runtime's job is podman's (runc): the image's root file system, the pod's volumes at their mountPaths,
its user and groups, the read-only root, no-new-privileges, the resources' limits, the pod's network namespace
(`--network ns:/run/netns/<pod>`, made by net.py). The kubelet's job stays in kubelet.py: probes, restarts and
termination, which drive a ContainerProcess as they would a process.

Why `podman run` and not `podman kube play`: kube play brings its own probes, restart policy and termination, which
would duplicate the kubelet the rehearsal implements and reports on (the rollout scenarios watch each pod's phase and
readiness as the rehearsal's kubelet sets them), and it would not run a pod in the rehearsal's network namespaces.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
from pathlib import Path

from image_build import containers
from rehearsal.podspec import PodPlan

# This machine's capacity: a container's CPU and memory limits are capped to it (podman refuses a CPU limit above
# the machine's CPUs). The cap is a substitution (substitutions.py).
MACHINE_CPUS = os.cpu_count() or 1
MACHINE_MEMORY_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
_FACTORS = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
            "Ti": 2**40}


class ContainerSpecError(ValueError):
    pass


def quantity(text: str | int | float, where: str) -> float:
    """A Kubernetes quantity (`1500m`, `16Gi`, `2`) as a number (cores or bytes)."""
    m = _QUANTITY.match(str(text))
    if not m:
        raise ContainerSpecError(f"{where}: {text!r} is not a Kubernetes quantity the rehearsal reads")
    return float(m.group(1)) * _FACTORS[m.group(2)]


def limits_argv(plan: PodPlan) -> list[str]:
    """podman's `--cpus` and `--memory` for the container's rendered limits, capped at this machine's."""
    limits = plan.resources.get("limits") or {}
    argv = []
    if "cpu" in limits:
        cpus = min(quantity(limits["cpu"], f"{plan.name} limits.cpu"), float(MACHINE_CPUS))
        argv += ["--cpus", f"{cpus:g}"]
    if "memory" in limits:
        memory = min(quantity(limits["memory"], f"{plan.name} limits.memory"), float(MACHINE_MEMORY_BYTES))
        argv += ["--memory", str(int(memory))]
    return argv


def run_argv(plan: PodPlan, image: str, name: str, netns: str) -> list[str]:
    """`podman run` of the pod's one container, as its plan says."""
    argv = containers.podman("run", "--rm", "--replace", "--name", name, "--network", f"ns:/run/netns/{netns}",
                             "--user", f"{plan.uid}:{plan.gid}", "--workdir", plan.workdir,
                             "--entrypoint", json.dumps(plan.argv[:1]), "--stop-timeout", str(math.ceil(
                                 plan.grace_period_s)), "--pull", "never",
                             "--hostname", plan.name)
    for group in plan.groups:
        argv += ["--group-add", str(group)]
    if plan.read_only_root:
        # --read-only-tmpfs=false: podman would otherwise mount tmpfs on /tmp, /var/tmp and /run, which a pod's
        # read-only root does not have (its writable paths are its volumes).
        argv += ["--read-only", "--read-only-tmpfs=false"]
    if plan.no_new_privs:
        argv += ["--security-opt", "no-new-privileges"]
    for mount in plan.mounts:
        if mount.kind == "tmpfs":
            argv += containers.tmpfs_argv(mount.target, mount.size)
        else:
            argv += ["--mount", f"type=bind,source={mount.source},destination={mount.target}"
                     + (",ro=true" if mount.read_only else "")]
    for key, value in sorted(plan.env.items()):
        argv += ["--env", f"{key}={value}"]
    argv += limits_argv(plan)
    return [*argv, image, *plan.argv[1:]]


class ContainerProcess:
    """A pod's container as the kubelet drives it: `podman run` attached (its status is the container's), signals
    sent to the container by podman, SIGKILL ending every process in it."""

    def __init__(self, argv: list[str], name: str, log_path: Path):
        self.name = name
        with open(log_path, "w") as log:
            self._client = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env=containers.environment())

    @property
    def pid(self) -> int:
        return self._client.pid

    @property
    def returncode(self) -> int | None:
        return self._client.returncode

    def poll(self) -> int | None:
        return self._client.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._client.wait(timeout=timeout)

    def send_signal(self, sig: int) -> None:
        subprocess.run(containers.podman("kill", "--signal", str(int(sig)), self.name), capture_output=True,
                       env=containers.environment())

    def kill_all(self) -> None:
        """SIGKILL to every process of the container (its cgroup), then the client's end."""
        if self._client.poll() is None:
            self.send_signal(signal.SIGKILL)
        try:
            self._client.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self._client.pid, signal.SIGKILL)
        subprocess.run(containers.podman("rm", "--force", "--ignore", self.name), capture_output=True,
                       env=containers.environment())

    def container_pid(self) -> int | None:
        """The container's first process as this machine sees it (None before it runs or after it ended)."""
        done = subprocess.run(containers.podman("inspect", "--format", "{{.State.Pid}}", self.name),
                              capture_output=True, text=True, env=containers.environment())
        pid = done.stdout.strip()
        return int(pid) if done.returncode == 0 and pid.isdigit() and pid != "0" else None


def in_image_root(pid: int, repo_root: Path) -> bool:
    """Whether process `pid` runs in an image's root file system, not this machine's: the stand-in base's
    environment is there and this checkout is not."""
    root = Path(f"/proc/{pid}/root")
    return (root / "opt" / "venv" / "bin" / "python3").exists() and not (root / repo_root.relative_to("/")).exists()


def processes_in_mount_namespace(pid: int) -> int:
    """How many processes share `pid`'s mount namespace (a container's processes: the startup, Triton's stub, the
    engines)."""
    try:
        namespace = os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return 0
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                count += os.readlink(entry / "ns" / "mnt") == namespace
            except OSError:
                continue
    return count
