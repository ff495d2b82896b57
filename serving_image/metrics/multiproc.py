"""vLLM's side of the merge: prometheus_client multiprocess files in `PROMETHEUS_MULTIPROC_DIR`.

Everything here follows prometheus_client's documented multiprocess mode:
- the files are read with its `MultiProcessCollector` (the same code vLLM's own /metrics uses);
- a process that has exited is passed to `multiprocess.mark_process_dead(pid, path)`, which removes its
  `live*` gauge files (its counters and histograms stay: they are totals since the start of the pod);
- the directory is emptied before the engine starts (docs/architecture.md §3.7 step 3): stale files of a previous
  container run would otherwise be added to the new counters.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from prometheus_client import multiprocess

from serving_image.metrics.exposition import Family, from_client_metrics

log = logging.getLogger(__name__)

# prometheus_client names its files <type>_<pid>.db, live gauges gauge_live<mode>_<pid>.db.
_LIVE_GAUGE_FILE = re.compile(r"^gauge_live[a-z]+_(\d+)\.db$")


def _require_dir(path: str | os.PathLike[str], what: str) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"{what}: {directory} is not a directory (set PROMETHEUS_MULTIPROC_DIR to one)")
    return directory


def clear_multiproc_dir(path: str | os.PathLike[str]) -> int:
    """Empty the multiprocess directory before the engine starts; create it if missing. Returns files removed.

    Only prometheus_client's `*.db` files are removed. Anything else in the directory is left alone and named in a
    warning: it means the variable points at a directory that is not vLLM's alone.
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    removed = 0
    others = []
    for entry in sorted(directory.iterdir()):
        if entry.is_file() and entry.suffix == ".db":
            entry.unlink()
            removed += 1
        else:
            others.append(entry.name)
    if others:
        log.warning(
            "PROMETHEUS_MULTIPROC_DIR %s holds entries that are not metrics files (left in place): %s",
            directory, ", ".join(others[:10]) + (" ..." if len(others) > 10 else ""),
        )
    log.info("emptied PROMETHEUS_MULTIPROC_DIR %s: %d stale metrics file(s) removed", directory, removed)
    return removed


# This process's id, read once and again in a forked child (see write_values_with_cached_pid).
_pid = [os.getpid()]


def _cached_pid() -> int:
    return _pid[0]


def _forked() -> None:
    _pid[0] = os.getpid()


def write_values_with_cached_pid() -> bool:
    """Make the metrics created from now on in this process tell their process apart by a pid read once (and again
    in a child after a fork) instead of `os.getpid()` at every write. False when this process is not in
    multiprocess mode (nothing changed).

    Why: a multiprocess value asks its process id at every inc/set/observe, to notice a fork and move to the
    child's own file. os.getpid() is a system call, and vLLM's stat logger writes dozens of values every engine step
    on the engine's own thread (7 % of that thread's samples at concurrency 1, in the backend stub). The pid read at
    a fork (os.register_at_fork) is what the check compares, so a forked child still gets files of its own;
    prometheus_client documents `MultiProcessValue(process_identifier)` for this, with the rule that processes
    running at once get distinct values, which pids are. Call it before the metrics are created (vLLM creates its
    own when the engine is built): a metric keeps the value class it was created with."""
    from prometheus_client import values

    if values.ValueClass is values.MutexValue:
        return False
    if getattr(values.ValueClass, "pid_cached", False):
        return True
    _forked()  # the pid of this process now, whatever it was at import
    os.register_at_fork(after_in_child=_forked)
    values.ValueClass = values.MultiProcessValue(process_identifier=_cached_pid)
    values.ValueClass.pid_cached = True
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def reap_dead_processes(path: str | os.PathLike[str]) -> list[int]:
    """`mark_process_dead` every process that left live-gauge files and no longer exists. Returns their pids.

    Only meaningful when the proxy shares the engine's PID namespace (one container, or `make up`).
    """
    directory = _require_dir(path, "multiprocess directory")
    dead = []
    for entry in directory.iterdir():
        match = _LIVE_GAUGE_FILE.match(entry.name)
        if match:
            pid = int(match.group(1))
            if pid != os.getpid() and pid not in dead and not _alive(pid):
                dead.append(pid)
    for pid in dead:
        multiprocess.mark_process_dead(pid, str(directory))
        log.info("metrics of exited process %d marked dead (its live gauges removed)", pid)
    return dead


def collect_multiproc(path: str | os.PathLike[str]) -> list[Family]:
    """Every family in the directory's files, merged across processes as prometheus_client defines it."""
    directory = _require_dir(path, "multiprocess directory")
    collector = multiprocess.MultiProcessCollector(None, path=str(directory))
    return from_client_metrics(collector.collect())
