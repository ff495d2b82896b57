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
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


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


def apply_mounts(mounts: list[dict]) -> None:
    for m in mounts:
        target = m["target"]
        if m["kind"] == "tmpfs":
            options = "mode=1777" + (f",size={m['size']}" if m.get("size") else "")
            _mount("-t", "tmpfs", "-o", options, "tmpfs", target)
        else:
            _mount("--bind", m["source"], target)
        if m.get("read_only"):
            _mount("-o", "remount,bind,ro", target)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    plan = json.loads(Path(argv[0]).read_text())
    _mount("--make-rprivate", "/")
    make_readable(plan["readable"], Path(plan["staging"]))
    apply_mounts(plan["mounts"])
    if plan["read_only_root"]:
        _mount("-o", "remount,bind,ro", "/")
    if plan["no_new_privs"]:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    # Like the container runtime: a WORKDIR that does not exist (on a fresh volume) is created for the user.
    workdir = Path(plan["workdir"])
    if not workdir.exists():
        workdir.mkdir(parents=True)
        os.chown(workdir, plan["uid"], plan["gid"])
    os.setgroups(plan["groups"])
    os.setgid(plan["gid"])
    os.setuid(plan["uid"])
    os.chdir(plan["workdir"])
    os.execvpe(plan["argv"][0], plan["argv"], plan["env"])


if __name__ == "__main__":
    main()
