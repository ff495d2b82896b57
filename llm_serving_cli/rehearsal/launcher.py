"""The container runtime's last step for one rehearsed pod, run as root inside the pod's own network namespace and
a private mount namespace (`ip netns exec <pod> unshare --mount ... python -m llm_serving_cli.rehearsal.launcher
PLAN.json`): bind the pod's volumes at their mountPaths, make the substituted interpreter readable to the pod's user,
turn the root file system read-only when the spec says so, drop to the pod's user and exec the entrypoint with the
pod's environment. Nothing here outlives the namespace.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

PR_SET_NO_NEW_PRIVS = 38


def _mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:  # the pod's log must say why, not only the status
        raise OSError(f"mount {' '.join(args)} failed (status {result.returncode}): "
                      f"{(result.stderr or result.stdout).strip()}")


def _hidden_ancestor(path: Path) -> Path | None:
    """The topmost ancestor of `path` that others cannot traverse (e.g. /root, mode 0700)."""
    for ancestor in list(reversed(path.parents))[1:] + [path]:
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


def make_readable(paths: list[str], staging: Path) -> None:
    """Bind each path at its own location below a fresh, traversable tmpfs laid over its hidden ancestor."""
    covered: set[Path] = set()
    pending = []
    for i, text in enumerate(paths):
        path = Path(text)
        hidden = _hidden_ancestor(path)
        if hidden is None:
            continue
        stage = staging / f"readable-{i}"
        stage.mkdir(parents=True, exist_ok=True)
        _mount("--bind", str(path), str(stage))
        pending.append((hidden, path, stage))
    for hidden, path, stage in pending:
        if hidden not in covered:
            _mount("-t", "tmpfs", "-o", "mode=0755,size=1m", "tmpfs", str(hidden))
            covered.add(hidden)
        path.mkdir(parents=True, exist_ok=True)
        _mount("--bind", str(stage), str(path))
        _mount("-o", "remount,bind,ro", str(path))


def _under(path: str, target: str) -> bool:
    return path == target or path.startswith(target.rstrip("/") + "/")


def mount_order(mounts: list[dict], keep_visible: list[str]) -> list[tuple[dict, list[str]]]:
    """The volumes in the order to mount them, each with the paths to keep visible inside it: those that hide no
    other volume's source and no kept path first, the hiding ones last."""
    sources = [m["source"] for m in mounts if m["kind"] != "tmpfs"]

    def hides(m: dict) -> bool:
        return any(_under(p, m["target"]) for p in [*sources, *keep_visible] if p != m.get("source"))

    ordered = [m for m in mounts if not hides(m)] + [m for m in mounts if hides(m)]
    return [(m, [p for p in keep_visible if _under(p, m["target"])]) for m in ordered]


def apply_mounts(mounts: list[dict], keep_visible: list[str]) -> None:
    """Mount the pod's volumes. A volume's mountPath may be an ancestor of a path the pod still needs from this
    machine: the scratch volume at /tmp hides a checkout under /tmp (its packages, the interpreter's environment) and
    the sources of the other volumes there. So the volumes that hide nothing are mounted first, and a hiding one
    last, carrying the paths to keep at their place inside it (bound into its source first, mounted recursively)."""
    for m, kept in mount_order(mounts, keep_visible):
        target = m["target"]
        if m["kind"] == "tmpfs":
            if kept:
                raise OSError(f"the tmpfs volume at {target} would hide {', '.join(kept)}, which the pod needs from "
                              "this machine: run the rehearsal from a checkout elsewhere")
            options = "mode=1777" + (f",size={m['size']}" if m.get("size") else "")
            _mount("-t", "tmpfs", "-o", options, "tmpfs", target)
        else:
            for path in kept:
                inner = Path(m["source"]) / os.path.relpath(path, target)
                inner.mkdir(parents=True, exist_ok=True)
                _mount("--rbind", path, str(inner))
            _mount("--rbind", m["source"], target)
        if m.get("read_only"):
            _mount("-o", "remount,bind,ro", target)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    plan = json.loads(Path(argv[0]).read_text())
    _mount("--make-rprivate", "/")
    make_readable(plan["readable"], Path(plan["staging"]))
    apply_mounts(plan["mounts"], plan["readable"])
    # Like the container runtime: a WORKDIR that does not exist (on a fresh volume) is created for the user. Before
    # the root turns read-only: a WORKDIR on no volume (the batch worker's: the image's own) is the image's
    # directory, which the image has and this machine may not.
    workdir = Path(plan["workdir"])
    if not workdir.exists():
        workdir.mkdir(parents=True)
        os.chown(workdir, plan["uid"], plan["gid"])
    if plan["read_only_root"]:
        _mount("-o", "remount,bind,ro", "/")
    if plan["no_new_privs"]:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.setgroups(plan["groups"])
    os.setgid(plan["gid"])
    os.setuid(plan["uid"])
    os.chdir(plan["workdir"])
    os.execvpe(plan["argv"][0], plan["argv"], plan["env"])


if __name__ == "__main__":
    main()
