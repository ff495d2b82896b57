"""The serving process's descendants: adopted when orphaned, and all killed on the way out.

Triton (embedded in this process) forks its Python backend stubs, and each LLM stub starts vLLM's engine processes.
A startup that gives up while they are still starting (a package whose checksum fails beside step 4) kills them
before it exits; but a process forked after the listing, or whose parent was killed first, would be re-parented to
init and outlive the pod's process, holding its output pipes and a CPU. `adopt_orphans` makes this process their
child subreaper (prctl PR_SET_CHILD_SUBREAPER, Linux 3.4+), so that such a process is re-parented here instead, and
`kill_descendants` lists and kills until none is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
KILL_PASSES = 10  # a pass catches what was forked, or re-parented here, while the previous one killed


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants; False (logged) where the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("orphaned descendants will go to init, not to this process: prctl(PR_SET_CHILD_SUBREAPER) "
                    "failed with errno %d", ctypes.get_errno())
        return False
    return True


def kill_descendants(timeout_s: float = 10.0) -> int:
    """SIGKILL every descendant of this process and reap them, pass after pass until a pass finds none; returns
    how many were killed."""
    import psutil

    me, killed = psutil.Process(), 0
    for _ in range(KILL_PASSES):
        found = me.children(recursive=True)
        if not found:
            break
        for process in found:
            with contextlib.suppress(psutil.Error):
                process.kill()
        killed += len(found)
        psutil.wait_procs(found, timeout=timeout_s)  # reaps this process's own children, adopted ones included
    return killed
