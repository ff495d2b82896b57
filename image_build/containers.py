"""buildah and podman as this machine runs them (docs/first-update.md, "The image built here"): the one place that knows
the settings they need here, used by `make image`, `make image-check` and the rehearsal's pods.

- buildah builds with `--isolation chroot` (the default OCI isolation fails here on setrlimit).
- podman runs with `--runtime runc` (crun refuses cgroups in hybrid mode; this machine has cgroup v1 controllers),
  `--cgroup-manager cgroupfs`, and a containers.conf without default ulimits and pid limits (the defaults' setrlimit
  calls are refused here).
- pip inside a build uses the machine's pip configuration (its index, extra indexes, find-links and certificate):
  bound in read-only for the build's RUN steps, never copied into an image.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from llm_serving.repository import REPO_ROOT

STATE = REPO_ROOT / ".cache" / "image"
CONTAINERS_CONF = """# Written by image_build/containers.py: this machine refuses the default ulimits and pid
# limits.
[containers]
default_ulimits = []
pids_limit = 0
"""
# What `apt-get` installs for the targets (Debian 12's packages).
DEBIAN_PACKAGES = ("buildah", "podman", "runc", "mmdebstrap")


class ContainerToolError(RuntimeError):
    pass


def require_tools() -> None:
    missing = [tool for tool in ("buildah", "podman", "runc", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        raise ContainerToolError(f"{', '.join(missing)} not found: `make image` installs Debian's "
                                 f"{' '.join(DEBIAN_PACKAGES)} (apt-get, as root)")


def environment() -> dict[str, str]:
    """The environment podman and buildah run with here (their containers.conf)."""
    STATE.mkdir(parents=True, exist_ok=True)
    conf = STATE / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(*args: str) -> list[str]:
    """A podman command line with this machine's settings."""
    return ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs", *args]


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a container tool, its error output in the exception when it fails."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    done = subprocess.run(argv, env=environment(), **kwargs)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout or "").strip() if kwargs.get("capture_output") else ""
        raise ContainerToolError(f"{' '.join(argv[:4])} ... failed (status {done.returncode})"
                                 + (f":\n{detail[-4000:]}" if detail else ""))
    return done


def image_exists(ref: str) -> bool:
    return subprocess.run(podman("image", "exists", ref), env=environment()).returncode == 0


def inspect(ref: str) -> dict:
    """`podman image inspect` of one image."""
    (data,) = json.loads(run(podman("image", "inspect", ref)).stdout)
    return data


@dataclass(frozen=True)
class PipSettings:
    """The machine's pip configuration for a build's RUN steps: a pip.conf and the local paths it names."""

    conf_text: str
    paths: tuple[str, ...]  # local files and directories the settings name (bound read-only at the same path)


def host_pip_settings(python: str = "python3") -> PipSettings:
    """The settings `pip config list` shows here (files and PIP_* environment alike), as one [global] section."""
    done = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
    files: dict[str, str] = {}
    environment: dict[str, str] = {}  # PIP_* variables: pip lets them override the files
    for line in done.stdout.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        name = key.rsplit(".", 1)[-1]
        (environment if key.startswith(":env:") else files)[name] = value.strip().strip("'\"")
    settings = {k: v for k, v in {**files, **environment}.items() if k != "config-file"}
    paths: set[str] = set()
    for value in settings.values():
        for word in value.split():
            path = word.removeprefix("file://").rstrip("/")
            if path.startswith("/") and Path(path).exists():
                # A local index (`.../simple`) links to files beside it: its parent is what the build needs.
                paths.add(str(Path(path).parent) if Path(path).name == "simple" else path)
    conf = "[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(settings.items()))
    return PipSettings(conf, tuple(sorted(paths)))


def build_volumes(settings: PipSettings) -> list[str]:
    """buildah `--volume` arguments that give a build's RUN steps the machine's pip settings, read-only."""
    STATE.mkdir(parents=True, exist_ok=True)
    conf = STATE / "pip.conf"
    conf.write_text(settings.conf_text)
    volumes = ["--volume", f"{conf}:/etc/pip.conf:ro"]
    for path in settings.paths:
        volumes += ["--volume", f"{path}:{path}:ro"]
    return volumes


def tmpfs_argv(target: str, size: str | None = None) -> list[str]:
    """A memory-backed volume at `target`: podman's own /dev/shm sized as asked (a second mount there is refused),
    else a fresh tmpfs owned by the container's user (an emptyDir; podman 4.3 under runc ignores `tmpfs-mode`)."""
    if target == "/dev/shm":
        return ["--shm-size", size or "64m"]
    return ["--mount", f"type=tmpfs,destination={target},chown=true" + (f",tmpfs-size={size}" if size else "")]
